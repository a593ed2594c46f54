"""`python -m serving.eval_tasks`: the older spelling of `qwen-jax eval`
(serving/bench/eval_tasks.py)."""

import sys

from serving.bench.eval_tasks import main

if __name__ == "__main__":
    sys.exit(main())
