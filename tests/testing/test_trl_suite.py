"""The TRL-suite harness without TRL's tests or a network: its verdict, its report parsing, its Hub stand-ins (loaded
through the libraries' offline mode in a fresh process) and the one difference between its two runs (``-p`` of a
module that imports trl_turbo)."""

from __future__ import annotations

import textwrap

from trl_turbo.testing import hub_standins, trl_suite

QWEN = "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5"


def test_regressions_are_tests_that_passed_stock_and_not_with_the_import():
    stock = {"a": ("passed", 1.0), "b": ("passed", 1.0), "c": ("failed", 1.0), "d": ("skipped", 0.0),
             "e": ("passed", 1.0), "f": ("passed", 1.0)}
    turbo = {"a": ("passed", 1.2), "b": ("failed", 1.0), "c": ("passed", 1.0), "d": ("skipped", 0.0),
             "e": ("error", 1.0)}  # "f" is missing from the second run
    assert trl_suite.regressions(stock, turbo) == ["b", "e", "f"]
    assert trl_suite.counts(turbo) == {"passed": 2, "failed": 1, "error": 1, "skipped": 1}


def test_junit_report_outcomes_and_times(tmp_path):
    report = tmp_path / "junit.xml"
    report.write_text(textwrap.dedent("""\
        <testsuites><testsuite>
          <testcase classname="tests.test_x.TestA" name="test_ok" time="1.5"/>
          <testcase classname="tests.test_x.TestA" name="test_bad[p]" time="2"><failure message="x"/></testcase>
          <testcase classname="tests.test_x" name="test_skip" time="0"><skipped message="s"/></testcase>
          <testcase classname="tests.test_x" name="test_teardown" time="1"/>
          <testcase classname="tests.test_x" name="test_teardown" time="0.5"><error message="e"/></testcase>
        </testsuite></testsuites>"""))
    assert trl_suite.parse_junit(report) == {
        "tests.test_x.TestA::test_ok": ("passed", 1.5),
        "tests.test_x.TestA::test_bad[p]": ("failed", 2.0),
        "tests.test_x::test_skip": ("skipped", 0.0),
        "tests.test_x::test_teardown": ("error", 1.5),
    }


# One synthetic file, run through the harness's two pytest runs (a fresh process each, so the offline switches are
# read at import as in the real runs): the stand-ins load under their Hub ids in both, trl_turbo is patched in the
# second only.
PROBE = f"""\
import sys

from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer


def test_standins_load_offline_under_their_hub_ids():
    model = AutoModelForCausalLM.from_pretrained("{QWEN}")
    tokenizer = AutoTokenizer.from_pretrained("{QWEN}")
    text = tokenizer.apply_chat_template([{{"role": "user", "content": "hé 2+2?"}}], tokenize=False,
                                         add_generation_prompt=True)
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text, text
    assert model.config.vocab_size == len(tokenizer) and str(model.dtype) == "torch.bfloat16"
    data = load_dataset("trl-internal-testing/zen", "conversational_prompt_only")
    assert {{k: len(v) for k, v in data.items()}} == {{"train": 17, "test": 2}}
    assert data["train"][0]["prompt"][0]["role"] == "user"


def test_trl_turbo_patched():
    assert "trl_turbo" in sys.modules and sys.modules["trl_turbo"].is_patched()
"""


def test_two_runs_load_the_standins_offline_and_only_the_second_imports_trl_turbo(tmp_path):
    hf_home = tmp_path / "hf_home"
    hub_standins.save_model(hf_home / "hub", QWEN)
    hub_standins.save_dataset(hf_home / "datasets", "trl-internal-testing/zen", "conversational_prompt_only")
    (tmp_path / "test_probe.py").write_text(PROBE)
    runs = trl_suite.run_twice(tmp_path, ["test_probe.py"], trl_suite.offline_env(hf_home), log=lambda _: None)
    stock, turbo = runs["stock"]["tests"], runs["with_import"]["tests"]
    logs = {name: (tmp_path / f"pytest-{name}.log").read_text()[-3000:] for name in runs}
    assert stock["test_probe::test_standins_load_offline_under_their_hub_ids"][0] == "passed", logs["stock"]
    assert stock["test_probe::test_trl_turbo_patched"][0] == "failed", logs["stock"]
    assert runs["with_import"]["counts"] == {"passed": 2, "failed": 0, "error": 0, "skipped": 0}, logs["with_import"]
    assert trl_suite.regressions(stock, turbo) == []


def test_a_comparison_of_runs_that_did_not_run_is_refused():
    def run(returncode, passed):
        return {"returncode": returncode, "counts": {"passed": passed, "failed": 0, "error": 0, "skipped": 0}}

    assert trl_suite.not_run({"stock": run(1, 3), "with_import": run(0, 3)}) == []
    assert trl_suite.not_run({"stock": run(0, 0), "with_import": run(0, 0)}) == ["stock: no test passed"]
    assert trl_suite.not_run({"stock": run(1, 3), "with_import": run(2, 0)}) == [
        "with_import: pytest exited with 2"]  # interrupted or a collection error: not a verdict
