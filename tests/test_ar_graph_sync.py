"""scripts/diagnostics/ar_graph_sync.py, the GPU measurement of ARGraphDecoder's sync_every, run on CPU (no graph):
every setting decodes the same tokens, and the table and records say so."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_sync_every_decodes_the_same_tokens_on_cpu(smollm2_dir, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "scripts/diagnostics/ar_graph_sync.py", "--out", str(tmp_path / "sync"),
                           "--eval-dir", "eval_data", "--sets", "mt_bench", "humaneval", "--num-prompts", "1",
                           "--sync", "1", "5", "--max-new-tokens", "12", "--repeats", "1",
                           "model.device=cpu", "model.dtype=float32"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads((tmp_path / "sync" / "sync.json").read_text())
    assert [r["sync_every"] for r in rec["rows"]] == [1, 5] and rec["device"] == "cpu"
    assert all(r["same_tokens"] == 2 and not r["graphed"] and r["tok_s_best"] > 0 for r in rec["rows"])
    assert "| 5 | " in proc.stdout and "| 2/2 |" in proc.stdout
