"""lm-evaluation-harness adapter: local tasks (a YAML over a jsonl file written here) through simple_evaluate and
the command line, compared with lm_eval's own `hf` model on the same weights and tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")
from hf_fixtures import llama_config, save_random_llama  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import meshloom.integrations.lm_eval  # noqa: E402, F401 (registers --model meshloom)

REPO = Path(__file__).resolve().parents[1]
QUESTIONS = [
    {"question": "def add(a, b):", "choices": [" return a + b", " return a - b"], "answer": 0, "target": " return"},
    {"question": "hello", "choices": [" world", " there", " fox"], "answer": 0, "target": " world"},
    {"question": "x = [i for i in", "choices": [" range(10)]", " x]"], "answer": 0, "target": " range"},
    {"question": "the quick brown", "choices": [" fox", " dog"], "answer": 0, "target": " fox"},
]
CHOICE_TASK = """task: meshloom_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""
GENERATE_TASK = """task: meshloom_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""
ROLLING_TASK = """task: meshloom_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{question}}}}{{{{choices[0]}}}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
"""
TASKS = ["meshloom_choice", "meshloom_generate", "meshloom_rolling"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, Path]:
    """(a random tiny Llama folder with tokenizer.json, a folder of task YAMLs over a local jsonl)."""
    from meshloom.data.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("lm_eval")
    model = root / "model"
    save_random_llama(model, llama_config(bos_token_id=0, eos_token_id=1), seed=7)
    texts = [q["question"] + c for q in QUESTIONS for c in q["choices"]]
    (model / "tokenizer.json").write_text(train_bpe(texts * 20, 300).to_str())
    # The generic fast tokenizer reads tokenizer.json as it is (no model-specific pre-processing).
    (model / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|eos|>", "clean_up_tokenization_spaces": False,
    }))  # fmt: skip
    tasks = root / "tasks"
    tasks.mkdir()
    data = tasks / "questions.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    for name, text in (("choice", CHOICE_TASK), ("generate", GENERATE_TASK), ("rolling", ROLLING_TASK)):
        (tasks / f"{name}.yaml").write_text(text.format(data=data))
    return model, tasks


def _tasks(folder: Path) -> TaskManager:
    """Only the tasks written here: indexing lm_eval's thousands of built-in task files takes half a minute."""
    return TaskManager(include_path=str(folder), include_defaults=False)


def _evaluate(model_name: str, model_args: str, tasks: Path) -> dict:
    return lm_eval.simple_evaluate(
        model=model_name, model_args=model_args, tasks=TASKS, task_manager=_tasks(tasks),
        device="cpu", batch_size=2, log_samples=True,
    )  # fmt: skip


def _scores(resps: list) -> list[float]:
    """Log-likelihoods of one sample: [[(ll, greedy)], ...] per choice, or [[ll]] for a rolling request."""
    return [float(r[0][0]) if isinstance(r[0], (list, tuple)) else float(r[0]) for r in resps]


def test_adapter_matches_lm_evals_hf_model(setup) -> None:
    model, tasks = setup
    ours = _evaluate("meshloom", f"path={model}", tasks)
    theirs = _evaluate("hf", f"pretrained={model},dtype=float32", tasks)
    for task in TASKS:
        ours_samples, their_samples = ours["samples"][task], theirs["samples"][task]
        assert len(ours_samples) == len(their_samples) == len(QUESTIONS)
        for a, b in zip(ours_samples, their_samples):
            if task == "meshloom_generate":
                assert a["resps"] == b["resps"]  # greedy text, token for token
                continue
            mine, reference = _scores(a["resps"]), _scores(b["resps"])
            assert len(mine) == len(reference) and max(abs(x - y) for x, y in zip(mine, reference)) <= 1e-4, (task, mine, reference)
    assert ours["results"]["meshloom_choice"]["acc,none"] == theirs["results"]["meshloom_choice"]["acc,none"]


def test_command_line_runs_the_adapter(setup, tmp_path: Path, subprocess_env) -> None:
    model, tasks = setup
    env = {**subprocess_env, "HF_DATASETS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "meshloom", "lm-eval", "--model", "meshloom", "--model_args", f"path={model}",
           "--tasks", "meshloom_choice", "--include_path", str(tasks), "--output_path", str(tmp_path / "out"), "--device", "cpu"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    assert results["results"]["meshloom_choice"]["alias"] == "meshloom_choice"
    assert 0.0 <= results["results"]["meshloom_choice"]["acc,none"] <= 1.0


def test_missing_model_path_and_task_fields_are_clear_errors(setup, tmp_path: Path, capsys) -> None:
    from meshloom.integrations.lm_eval_tasks import check_task_files, main

    model, tasks = setup
    with pytest.raises(ValueError, match=r"--model_args needs path="):
        lm_eval.simple_evaluate(model="meshloom", model_args="", tasks=["meshloom_choice"], task_manager=_tasks(tasks))
    check_task_files(tasks)  # the good ones pass
    data = tasks / "questions.jsonl"
    cases = [
        (CHOICE_TASK.replace('doc_to_text: "{{{{question}}}}"\n', ""), r"task 'meshloom_choice' in .*t.yaml has no 'doc_to_text'"),
        (CHOICE_TASK.replace('doc_to_choice: "{{{{choices}}}}"\n', ""), r"has no 'doc_to_choice', which an output_type 'multiple_choice' task needs"),
        (CHOICE_TASK.replace("test_split: test\n", ""), r"names no split to evaluate: set test_split or validation_split"),
        (ROLLING_TASK.replace('doc_to_target: "{{{{question}}}}{{{{choices[0]}}}}"\n', ""), r"has no 'doc_to_target'"),
    ]
    for i, (text, message) in enumerate(cases):
        broken = tmp_path / f"broken{i}"
        broken.mkdir()
        (broken / "t.yaml").write_text(text.format(data=data))
        with pytest.raises(ValueError, match=message):
            check_task_files(broken)
    # The command line checks before lm_eval starts.
    assert main(["--model", "meshloom", "--model_args", f"path={model}", "--tasks", "meshloom_choice", "--include_path", str(tmp_path / "broken0")]) == 2
    assert "has no 'doc_to_text'" in capsys.readouterr().err
