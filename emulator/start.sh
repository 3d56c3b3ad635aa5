#!/usr/bin/env bash
# Start the Pub/Sub emulator on 127.0.0.1:${PORT:-8085} and print the export line to use it.
# Uses Docker when an engine answers, else the gcloud CLI's installed emulator.
set -euo pipefail
PORT="${PORT:-8085}"
PROJECT="${PROJECT:-workerpool-local}"
echo "export PUBSUB_EMULATOR_HOST=127.0.0.1:${PORT}"
if docker info >/dev/null 2>&1; then
  exec docker compose -f "$(dirname "$0")/compose.yaml" up
fi
exec gcloud beta emulators pubsub start --host-port="127.0.0.1:${PORT}" --project="${PROJECT}"
