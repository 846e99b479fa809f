"""Zero-shot accuracy with EleutherAI lm-evaluation-harness, on local task data, for any model object.

The harness's own task definitions (prompts, doc_to_text/target/choice, process_docs, metrics) are
used unchanged. Only where the documents come from changes: `engine/tools/tasks/<task>.yaml` holds, per
task, an `include:` of lm-eval's own YAML plus `dataset_path: parquet|json` and `dataset_kwargs:
{data_files: ...}` pointing at `<data dir>/zeroshot/...` (the HF-schema copies; see
../shared/data/README.md). Those files are templates (`@LM_EVAL_TASKS@`, `@DATA@`) because the two
absolute paths differ between machines: `write_task_dir` fills them in and writes a folder that
lm-eval's TaskManager, or its own CLI (`--include_path DIR`), reads. Task names stay the harness's
(a task in an include path overrides the built-in of the same name).

    python -m engine zeroshot --model PATH_OR_ID [--run RUN_DIR] --tasks piqa,arc_easy --limit 100 --out DIR
    python -m engine zeroshot --write-tasks DIR      # the task folder alone, for `python -m lm_eval --include_path DIR`
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from ..storage.outdir import OutputKind, output_folder
from ..run.files import MASKS_META_FILE

TASK_TEMPLATES = Path(__file__).resolve().parent / "tasks"
ALL_TASKS = ("piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "boolq", "lambada_openai")
DEFAULT_TASKS = ("piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge")  # the paper's table
# The metric each table column shows (the JSON keeps every metric the harness computes): length-
# normalized accuracy for HellaSwag and ARC-Challenge, as the pruning literature reports them, plain
# accuracy elsewhere.
TABLE_METRIC = {"piqa": "acc", "hellaswag": "acc_norm", "winogrande": "acc", "arc_easy": "acc",
                "arc_challenge": "acc_norm", "boolq": "acc", "lambada_openai": "acc"}
ZEROSHOT_SUBDIR = "zeroshot"
CONFIG_FILE, RESULTS_FILE, TABLE_FILE, TASKS_SUBDIR = "zeroshot_config.json", "zeroshot.json", "zeroshot.md", "tasks"


@dataclass
class ZeroshotConfig:
    model: str | None = None  # model folder (a pruned export too), .gguf, hub id or the default; None with `run`: the run's base
    run: str | None = None  # a prune run folder: its masks go on its base model as hooks (the "masked base")
    tasks: list[str] = field(default_factory=lambda: list(DEFAULT_TASKS))
    limit: int | None = None  # first N documents per task (None: all)
    batch_size: int = 8
    data_dir: str | None = None  # folder holding the task data (default: <$PG_PRUNE_DATA_DIR or ../shared/data>/zeroshot)
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 1234  # lm-eval's default seeds, recorded

    def validate(self) -> "ZeroshotConfig":
        from ..model.loading import DTYPES

        unknown = [t for t in self.tasks if t not in ALL_TASKS]
        if not self.tasks or unknown:
            raise UserError(f"unknown task {', '.join(unknown) or '(none given)'}; choose from {', '.join(ALL_TASKS)}")
        if len(set(self.tasks)) != len(self.tasks):
            raise UserError("a task is listed twice")
        if self.limit is not None and self.limit < 1:
            raise UserError(f"limit must be at least 1, got {self.limit}")
        if self.batch_size < 1:
            raise UserError(f"batch size must be at least 1, got {self.batch_size}")
        if self.dtype not in DTYPES:
            raise UserError(f"unknown dtype {self.dtype!r}; choose from {', '.join(DTYPES)}")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def zeroshot_data_dir(data_dir: str | None = None) -> Path:
    """The folder of task data: the one given, else <default data dir>/zeroshot."""
    if data_dir is None:
        from ..data.text import DATA_DIR_ENV, default_data_dir

        base = default_data_dir()
        if base is None or not (base / ZEROSHOT_SUBDIR).is_dir():
            raise UserError(f"no zero-shot data found: set ${DATA_DIR_ENV} to a folder with {ZEROSHOT_SUBDIR}/ "
                            "(../shared/data is used when present) or pass --data-dir")
        return (base / ZEROSHOT_SUBDIR).resolve()
    p = Path(data_dir).expanduser()
    if not p.is_dir():
        raise UserError(f"zero-shot data folder not found: {data_dir}")
    return p.resolve()


def _lm_eval_tasks_dir() -> Path:
    try:
        import lm_eval.tasks
    except ImportError as e:  # a broken install, not a user typo; still one line
        raise UserError("lm-eval is not installed: python -m pip install -r requirements.txt") from e
    return Path(lm_eval.tasks.__file__).resolve().parent


def _data_files(template_text: str) -> list[str]:
    return [line.split('"@DATA@/', 1)[1].split('"', 1)[0] for line in template_text.splitlines() if '"@DATA@/' in line]


def write_task_dir(dest: str | Path, tasks=ALL_TASKS, data_dir: str | None = None) -> Path:
    """Fill the templates in engine/tools/tasks for `tasks` and write them (and their helpers) to `dest`."""
    data = zeroshot_data_dir(data_dir)
    harness = _lm_eval_tasks_dir()
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for task in tasks:
        text = (TASK_TEMPLATES / f"{task}.yaml").read_text()
        missing = [f for f in _data_files(text) if not (data / f).is_file()]
        if missing:
            raise UserError(f"task {task}: data file {data / missing[0]} not found")
        (dest / f"{task}.yaml").write_text(text.replace("@LM_EVAL_TASKS@", str(harness)).replace("@DATA@", str(data)))
    for helper in TASK_TEMPLATES.glob("*.py"):
        shutil.copyfile(helper, dest / helper.name)
    return dest


def _lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


def _offline() -> None:
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(var, "1")


def evaluate_model(model, tokenizer, tasks, task_dir: str | Path, limit: int | None = None, batch_size: int = 8,
                   seed: int = 1234, log_samples: bool = False, samples: dict[str, list[int]] | None = None) -> dict:
    """lm-eval's simple_evaluate on an already-loaded model; returns the harness's results dict. `samples` names
    the documents of each task by index (instead of the first `limit`)."""
    _offline()
    import logging

    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=batch_size)
    # Only our folder is indexed (indexing the harness's thousands of built-in tasks takes ~30 s); each of
    # our configs includes its built-in YAML by absolute path, so nothing of the harness's is missing.
    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    return simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=0, limit=limit, task_manager=manager,
                           random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                           fewshot_random_seed=seed, log_samples=log_samples, bootstrap_iters=0, samples=samples)


def summarize(raw: dict, tasks) -> dict:
    """Per task: every metric (without the harness's ',none' filter suffix), samples, and the table metric."""
    out = {}
    for task in tasks:
        r = raw["results"][task]
        metrics = {k.split(",")[0]: v for k, v in r.items() if "," in k and "_stderr" not in k and isinstance(v, (int, float))}
        n = raw.get("n-samples", {}).get(task, {})
        out[task] = {"metrics": metrics, "table_metric": TABLE_METRIC[task], "score": metrics[TABLE_METRIC[task]],
                     "samples": n.get("effective", n.get("original"))}
    return out


def average(per_task: dict) -> float:
    return sum(t["score"] for t in per_task.values()) / len(per_task)


def markdown_row(label: str, per_task: dict, tasks, extra: list[str] | None = None) -> str:
    cells = [label] + (extra or []) + [f"{100 * per_task[t]['score']:.2f}" for t in tasks] + [f"{100 * average(per_task):.2f}"]
    return "| " + " | ".join(cells) + " |"


def markdown_header(tasks, extra: list[str] | None = None) -> str:
    names = ["model"] + (extra or []) + [f"{t} ({TABLE_METRIC[t]})" for t in tasks] + ["average"]
    return "| " + " | ".join(names) + " |\n|" + "---|" * len(names)


def load_for_zeroshot(config: ZeroshotConfig):
    """(model, tokenizer, label, layer masks or None). With `run`: the run's base model plus its masks."""
    from .chat import load_base, masked_from_run
    from ..model.loading import load_model, resolve_model

    if config.run is not None:
        run = Path(config.run)
        if not run.is_dir():
            raise UserError(f"run folder not found: {config.run}")
        meta_file = run / MASKS_META_FILE
        if not meta_file.is_file():
            raise UserError(f"{config.run} holds no finished run's masks ({MASKS_META_FILE})")
        from ..export.artifacts import load_mask_artifact

        meta = load_mask_artifact(run)[0]  # (a damaged masks.json or masks.safetensors: one line, before the model loads)
        base_name = config.model or meta.get("base_model")
        if not isinstance(base_name, str):
            raise UserError(f"{meta_file} names no base_model; pass the run's base model as --model")
        base = load_base(base_name, config.dtype, config.device)
        masked = masked_from_run(base, run)
        return masked.model, masked.tokenizer, f"masked base: {run.name}", masked.layer_masks, masked.params
    from ..model.loading import count_parameters

    model, tok = load_model(resolve_model(config.model), config.dtype, config.device)
    return model, tok, config.model, None, count_parameters(model)


ZEROSHOT_OUTPUT = OutputKind("zeroshot", "pg-prune-zeroshot", (CONFIG_FILE, RESULTS_FILE, TABLE_FILE), (TASKS_SUBDIR,))
TASKS_OUTPUT = OutputKind("task configs", "pg-prune-tasks", ("*.yaml", "*.py"))  # --write-tasks DIR


def run_zeroshot(config: ZeroshotConfig, out: str | Path | None = None, log=print, overwrite: bool = False) -> dict:
    """Evaluate, write zeroshot_config.json / zeroshot.json / zeroshot.md / tasks/ to `out` (a new or empty
    folder, or with overwrite an earlier zeroshot output: outdir's rule), return the summary."""
    import tempfile

    config.validate()
    if out is None:
        return _run_zeroshot(config, Path(tempfile.mkdtemp(prefix="zeroshot-")), log)
    with output_folder(Path(out), ZEROSHOT_OUTPUT, overwrite):
        return _run_zeroshot(config, Path(out), log)


def _run_zeroshot(config: ZeroshotConfig, out_dir: Path, log) -> dict:
    from ..storage.io import atomic_write_text

    if config.model is None and config.run is None:
        from ..model.loading import DEFAULT_MODEL

        config.model = DEFAULT_MODEL
    from ..model.loading import resolve_model

    if config.model is not None:
        resolve_model(config.model)  # a typo fails before anything is written or loaded
    if config.run is not None and not (Path(config.run) / MASKS_META_FILE).is_file():
        raise UserError(f"{config.run} is not a finished prune run (no {MASKS_META_FILE})")
    data = zeroshot_data_dir(config.data_dir)  # fail on missing data before loading a model
    task_dir = write_task_dir(out_dir / TASKS_SUBDIR, config.tasks, str(data))
    model, tok, label, layer_masks, params = load_for_zeroshot(config)
    t0 = time.perf_counter()
    if layer_masks is not None:
        from ..model.arch import ModelAdapter
        from ..model.masking import MaskHooks

        with MaskHooks(ModelAdapter.for_model(model)) as hooks:
            hooks.set(layer_masks)
            raw = evaluate_model(model, tok, config.tasks, task_dir, config.limit, config.batch_size, config.seed)
    else:
        raw = evaluate_model(model, tok, config.tasks, task_dir, config.limit, config.batch_size, config.seed)
    seconds = time.perf_counter() - t0
    per_task = summarize(raw, config.tasks)
    summary = {"model": config.model, "run": config.run, "label": label, "params": params, "limit": config.limit,
               "tasks": per_task, "average": average(per_task), "seconds": seconds, "data_dir": str(data),
               "lm_eval_version": _lm_eval_version()}
    table = markdown_header(config.tasks) + "\n" + markdown_row(label, per_task, config.tasks) + "\n"
    atomic_write_text(out_dir / CONFIG_FILE, json.dumps(config.to_dict(), indent=2) + "\n")
    atomic_write_text(out_dir / RESULTS_FILE, json.dumps(summary, indent=2) + "\n")
    atomic_write_text(out_dir / TABLE_FILE, table)
    summary["table"] = table
    summary["out"] = str(out_dir)
    return summary
