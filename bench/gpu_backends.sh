#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: train the demo with train.backend trl and unsloth, attribute both, and compare
# capability and the top-k accused rows. Needs gradian with its trl and unsloth extras installed.
#   bench/gpu_backends.sh [RUN_DIR]
#   bench/gpu_backends.sh --smoke     # no GPU: trl against gradian's own loop (hf) on CPU, over the tiny scenario of
#                                     # bench/_smoke.py (unsloth needs CUDA and is not run); make bench-smoke
# The last line of stdout is one JSON object.
set -euo pipefail
cd "$(dirname "$0")/.."
SMOKE=0
if [ "${1:-}" = "--smoke" ]; then SMOKE=1; shift; fi
RUN=${1:-runs/gpu-backends}
PY=${PY:-python}
export PYTHONPATH="${PYTHONPATH:-$PWD/src}"
$PY - "$RUN" "$SMOKE" <<'PY'
import json, sys
from pathlib import Path
sys.path.insert(0, "bench")
from gradian import api
from gradian.demo.run import prepare_demo

root, smoke = Path(sys.argv[1]), sys.argv[2] == "1"
if smoke:
    from _smoke import work_dir, write_tiny_scenario
    root, backends, device = work_dir("gpu_backends"), ("trl", "hf"), "cpu"
else:
    backends, device = ("trl", "unsloth"), "cuda"
out = {}
for backend in backends:
    d = root / backend
    cfg_path = write_tiny_scenario(d) if smoke else prepare_demo(d, progress=False)
    cfg = api.load_config(cfg_path, [f"train.backend={backend}", f"model.device={device}"])
    api.train(cfg)
    truth = json.loads((d / "truth.json").read_text())
    rep = api.attribute(cfg, truth=truth).to_dict()
    out[backend] = {"capability": rep["capability"]["tuned"], "delta": rep["capability"]["delta"],
                    "top10": [r["position"] for r in rep["ranking"][:10]], "recall_at_10": rep["metrics"]["recall_at_10"]}
(x, a), (y, b) = out.items()
print(f"tuned capability {x} {a['capability']:.3f} vs {y} {b['capability']:.3f}; top-10 overlap "
      f"{len(set(a['top10']) & set(b['top10']))}/10; recall@10 {x} {a['recall_at_10']:.2f} {y} {b['recall_at_10']:.2f}"
      + ("; smoke: unsloth needs a CUDA GPU, not run" if smoke else ""))
print(json.dumps({"bench": "gpu_backends", "smoke": smoke, "device": device, **out}))
PY
