#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: train the demo with train.backend trl and unsloth, attribute both, and compare
# capability and the top-k accused rows. Needs gradian with its trl and unsloth extras installed.
#   bench/gpu_backends.sh [RUN_DIR]
set -euo pipefail
RUN=${1:-runs/gpu-backends}
PY=${PY:-python}
$PY - "$RUN" <<'PY'
import json, sys
from pathlib import Path
from gradian import api
from gradian.demo.run import prepare_demo

root = Path(sys.argv[1])
out = {}
for backend in ("trl", "unsloth"):
    d = root / backend
    cfg_path = prepare_demo(d, progress=False)
    cfg = api.load_config(cfg_path, [f"train.backend={backend}", "model.device=cuda"])
    api.train(cfg)
    truth = json.loads((d / "truth.json").read_text())
    rep = api.attribute(cfg, truth=truth).to_dict()
    out[backend] = {"capability": rep["capability"]["tuned"], "delta": rep["capability"]["delta"],
                    "top10": [r["position"] for r in rep["ranking"][:10]], "recall_at_10": rep["metrics"]["recall_at_10"]}
a, b = out["trl"], out["unsloth"]
print(json.dumps(out, indent=2))
print(f"tuned capability trl {a['capability']:.3f} vs unsloth {b['capability']:.3f}; top-10 overlap "
      f"{len(set(a['top10']) & set(b['top10']))}/10; recall@10 trl {a['recall_at_10']:.2f} unsloth {b['recall_at_10']:.2f}")
PY
