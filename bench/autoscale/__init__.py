"""``python -m bench.autoscale``: the autoscaler in simulation, against always-on,
a KEDA-like scaler and the oracle, on a month-end spike, a steady rate and a day."""
