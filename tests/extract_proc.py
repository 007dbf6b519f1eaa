"""Run one Prefect-free extraction in a subprocess (the kill tests SIGKILL it at chosen points)."""

import json
import sys
from pathlib import Path

import torch  # noqa: E402

torch.set_num_threads(1)

from tests.helpers import extract_local  # noqa: E402

if __name__ == "__main__":
    out, overrides = sys.argv[1], json.loads(sys.argv[2])
    ex = extract_local(Path(out), overrides)
    print(json.dumps({"forward_passes": ex.result.forward_passes}))
