"""``python -m bench.autoscale``: issue 17's autoscaler in simulation, against always-on,
a KEDA-like scaler and the oracle, on a month-end spike, a steady rate and a day."""
