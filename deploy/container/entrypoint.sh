#!/bin/sh
# The container's command, run under tini (PID 1, which forwards SIGTERM so that the
# server drains): `pagoda serve` with its flags from the environment. PAGODA_<FLAG>
# variables are flags (the CLI reads them: PAGODA_MAX_MODEL_LEN=4096 is
# --max-model-len 4096); MODEL, as other images name it, is the model when PAGODA_MODEL is
# not set. Arguments given to the container are passed on (and win over the variables).
set -eu
if [ -n "${MODEL:-}" ] && [ -z "${PAGODA_MODEL:-}" ]; then
    PAGODA_MODEL="$MODEL"
    export PAGODA_MODEL
fi
exec pagoda serve "$@"
