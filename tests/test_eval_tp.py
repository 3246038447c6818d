"""``tp_ar`` (AR with DeepSpeed AutoTP over every rank): where it is refused, and the ``x tp_ar`` column of the speed
table. Its tokens over 2 gloo ranks are checked end to end in ``tests/test_eval_cli.py``."""

from __future__ import annotations

import pytest

from spd_ds.config import ConfigError
from spd_ds.eval.benchmark import SuiteRun, speed_headers, speed_rows, with_tp
from spd_ds.eval.tp_baseline import check_tp_request, tp_unsupported
from spd_ds.models.adapter import TargetArch
from tests.tiny_models import make_tiny_model


def test_refusals(tiny_root):
    dense = TargetArch(make_tiny_model(tiny_root, "qwen3", 4))
    hybrid = TargetArch(make_tiny_model(tiny_root, "qwen3_5_text", 8))
    check_tp_request(["ar"], "reference", 1, hybrid)  # not asked for: nothing to refuse
    check_tp_request(["ar", "tp_ar"], "deepspeed", 2, dense)
    with pytest.raises(ConfigError, match="needs the pipeline engine over >= 2 ranks"):
        check_tp_request(["tp_ar"], "reference", 1, dense)
    with pytest.raises(ConfigError, match="needs the pipeline engine over >= 2 ranks"):
        check_tp_request(["tp_ar"], "deepspeed", 1, dense)
    assert tp_unsupported(dense) is None
    with pytest.raises(ConfigError, match="AutoTP cannot split qwen3_5_text's linear-attention"):
        check_tp_request(["tp_ar"], "deepspeed", 2, hybrid)


def _suite(methods: dict) -> SuiteRun:
    block = {"decode_tok_s": 100.0, "cycle_time_split_ms": {"cycle": 5.0}, "equivalent_accept_length": 1.5,
             "draft_acceptance_rate": 0.5, "achieved_gbps": None, "hbm_fraction": None}
    results = {name: {"overall": dict(block, speedup_vs_ar={"ar_graph": 1.2, "hf_generate": 3.0, "tp_ar": 0.9})}
               for name in methods}
    return SuiteRun("b", "shape n=2", [], summary={"methods": {n: {"kind": k} for n, k in methods.items()},
                                                   "results": results, "bandwidth": None})


def test_tp_column_only_when_measured():
    plain = _suite({"spd": "spd", "ar_graph": "baseline"})
    tp = _suite({"spd": "spd", "ar_graph": "baseline", "tp_ar": "baseline"})
    assert not with_tp([plain]) and with_tp([plain, tp])
    heads = speed_headers([plain, tp])
    assert heads[heads.index("x hf_generate") + 1] == "x tp_ar"
    for sr in (plain, tp):
        for row in speed_rows(sr, with_tp([plain, tp])):
            assert len(row) == len(heads)
            assert row[heads.index("x tp_ar")] == pytest.approx(0.9) and row[heads.index("eq. accept len")] == 1.5
    assert "x tp_ar" not in speed_headers([plain]) and len(speed_rows(plain)[0]) == len(speed_headers([plain]))
