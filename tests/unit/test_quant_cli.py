"""`python -m flashx_batch.quantize` argument handling (the pipeline itself: test_quant_plan.py)."""

from __future__ import annotations

import pytest

from flashx_batch.errors import ConfigError
from flashx_batch.quantize import main, parse_args


def test_issue_command_line_parses():
    args = parse_args(["model.path=/m", "calib.path=/c.jsonl", "budget.max_ppl_increase=0.05",
                       "quant.formats=[int8,int4]", "eval.windows=32"])
    assert args.model.path == "/m" and args.calib.path == "/c.jsonl"
    assert args.budget.max_ppl_increase == 0.05 and args.quant.formats == ["int8", "int4"]
    assert args.eval.windows == 32 and args.calib.windows == 16  # untouched defaults stay


@pytest.mark.parametrize("bad", [["budget.max_ppl=0.05"], ["budget.max_ppl_increase=lots"], ["model.path"]])
def test_bad_arguments_are_config_errors(bad):
    with pytest.raises(ConfigError):
        parse_args(bad)


def test_bad_arguments_exit_2():
    assert main(["nonsense.key=1"]) == 2
    assert main(["quant.formats=[int3]"]) == 2
