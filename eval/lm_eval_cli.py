"""``retrofit-lm-eval``: lm-eval's own CLI with retrofit imported (lm-eval has no plugin entry points).

    retrofit-lm-eval run --model hf --model_args pretrained=runs/gemma-macchiato --tasks hellaswag
    retrofit-lm-eval run --model retrofit --model_args pretrained=runs/gemma-macchiato --tasks hellaswag

Importing retrofit registers the converted model types with transformers, so lm-eval's own ``hf``
model loads a converted folder as the converted model, and adds the ``retrofit`` model (which
also takes base folders, GGUF files and the ``gemma3-270m`` alias). Plain ``lm_eval --model hf``
refuses a converted folder (transformers does not know ``retrofit_<family>``) instead of
evaluating its base. ``python -m retrofit.eval.lm_eval_cli`` is the same program.
Every lm-eval argument works as usual. Without ``--include_path``, the bundled task folder
(``eval/tasks``: the offline ``retrofit_tiny`` tasks) is added so ``--tasks retrofit_tiny`` works.
"""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    from retrofit.eval import register_lm_eval_model
    from retrofit.eval.harness import TASKS_DIR

    if not register_lm_eval_model():
        raise SystemExit("retrofit-lm-eval: error: lm-eval is not installed: pip install 'retrofit[eval]'")
    args = with_task_folder(list(sys.argv[1:] if argv is None else argv), str(TASKS_DIR))
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm-eval", *args]
    cli_evaluate()


def with_task_folder(args: list[str], folder: str) -> list[str]:
    """``args`` plus ``--include_path folder`` unless an include path is already given."""
    if any(a == "--include_path" or a.startswith("--include_path=") for a in args):
        return args
    if not args or args in (["run"], ["-h"], ["--help"]):
        return args
    return [*args, "--include_path", folder]


if __name__ == "__main__":
    main()
