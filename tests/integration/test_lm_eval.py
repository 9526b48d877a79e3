"""lm-eval, unchanged, scores pdserve as it scores transformers on the same checkpoint.

EleutherAI's lm-evaluation-harness (``lm_eval``) runs a small local multiple-choice task
(``tests/data/lm_eval``: 24 general-knowledge questions, scored by loglikelihood) twice:
with its ``local-completions`` model against a Coordinator in front of a prefill and a
decode engine (SmolLM2-135M-Instruct's float32 checkpoint, ``tests/real_model.py``), and
with its ``hf`` model (transformers) on the same checkpoint. Each loglikelihood request
is lm-eval's own: ``prompt: [[ids]]``, ``echo``, ``logprobs: 1``, ``max_tokens: 1``,
through both legs of PD. The two runs give the same accuracy, the same answer on every
question, and the same loglikelihood for every choice (float32 both sides).
"""

from __future__ import annotations

import pytest

from tests.integration.test_coordinator_pd import assert_all_free
from tests.integration.test_real_model import ENGINE_ARGS, coordinator
from tests.procs import PDSERVE, REPO, Proc
from tests.real_model import hf_checkpoint
from tests.unit.coordinator.harness import metric

TASK = "pdserve_general_knowledge"
NUM_QUESTIONS = 24
LOGLIKELIHOOD_TOLERANCE = 1e-3


@pytest.fixture
def offline(monkeypatch):
    """No network: lm-eval reads the task's data file, both models read the checkpoint;
    the task's data file is named relative to the repository root, as the CLI runs."""
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.chdir(REPO)


def evaluate(model: str, model_args: str) -> dict:
    """lm-eval's ``simple_evaluate`` on the local task: its accuracy and samples (by doc id)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    # Only the local task is indexed: lm-eval's own ~14,000 task files take seconds.
    tasks = TaskManager(include_path=str(REPO / "tests/data/lm_eval"), include_defaults=False)
    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK],
                                      task_manager=tasks, log_samples=True)
    samples = results["samples"][TASK]
    return {"acc": results["results"][TASK]["acc,none"],
            "samples": {s["doc_id"]: s for s in samples}}


def loglikelihoods(sample: dict) -> list[float]:
    return [loglikelihood for loglikelihood, _ in sample["filtered_resps"]]


def greedy(sample: dict) -> list[bool]:
    """Per choice: is it the model's greedy continuation (from ``top_logprobs`` for the API)."""
    return [is_greedy for _, is_greedy in sample["filtered_resps"]]


def argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


def test_lm_eval_scores_pdserve_as_it_scores_transformers(offline, loop):
    import torch

    checkpoint = hf_checkpoint()
    # The engines start while transformers answers, on one thread of the test process
    # (two cores: more threads only contend with the engines).
    procs = {role[0].upper(): Proc([*PDSERVE, "engine", "--model", str(checkpoint),
                                    "--role", role, *ENGINE_ARGS])
             for role in ("prefill", "decode")}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hf = evaluate("hf", f"pretrained={checkpoint},dtype=float32,device=cpu")
        engines = {n: p.wait_for(r"serving model .* on (\S+:\d+)", 240).group(1)
                   for n, p in procs.items()}
        with coordinator(loop, engines, ["P", "D"], str(checkpoint)) as app:
            served = evaluate("local-completions", ",".join([
                "model=smollm2", f"base_url={app.url}/v1/completions",
                "tokenizer_backend=huggingface", f"tokenizer={checkpoint}",
                "tokenized_requests=True", "num_concurrent=1", "max_retries=1"]))
            # One request per choice, each through both legs, none failed or retried.
            num_choices = sum(len(s["doc"]["choices"]) for s in hf["samples"].values())
            assert metric(app, "pdserve_coordinator_requests_total", endpoint="completions",
                          code="200") == num_choices
            assert metric(app, "pdserve_coordinator_routing_decisions_total", pool="prefill",
                          policy=app.deps.settings.prefill_policy) == num_choices
            assert metric(app, "pdserve_coordinator_local_prefills_total") == 0
        assert_all_free(engines, "P", "D")
    finally:
        torch.set_num_threads(threads)
        for p in procs.values():
            p.stop()

    assert len(hf["samples"]) == len(served["samples"]) == NUM_QUESTIONS
    assert served["acc"] == hf["acc"] >= 0.5, (served["acc"], hf["acc"])
    for doc_id, want in hf["samples"].items():
        got = served["samples"][doc_id]
        want_lls, got_lls = loglikelihoods(want), loglikelihoods(got)
        assert len(got_lls) == len(want_lls) == len(want["doc"]["choices"]), doc_id
        assert argmax(got_lls) == argmax(want_lls), (doc_id, got_lls, want_lls)
        assert got_lls == pytest.approx(want_lls, abs=LOGLIKELIHOOD_TOLERANCE), doc_id
        assert greedy(got) == greedy(want), doc_id
        assert got["acc"] == want["acc"], doc_id
