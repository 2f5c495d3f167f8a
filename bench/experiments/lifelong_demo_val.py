"""Whether the lifelong demo's stream shows routed-lora's lead over a nearest class mean, on VALIDATION streams.

    OMP_NUM_THREADS=1 python bench/experiments/lifelong_demo_val.py 16 5     # training, test texts per intent

The demo's shape (`ecru.lifelong.demo.STREAM`: 3 CLINC domains, Banking77 2 per class) on CLINC's validation
split, (seed, order) = (0, 0), (1, 1), (2, 2), with the demo's training settings; prints each run's
task-agnostic Last of routed-lora and ncm, the lead, and routed-lora's Banking77 change. About 2 min a run.
"""

import sys

import torch

from ecru.lifelong.experiment import Experiment
from ecru.lifelong.methods import TrainConfig
from ecru.lifelong.stream import StreamConfig

if __name__ == "__main__":
    torch.set_num_threads(1)
    train_per_intent, test_per_intent = int(sys.argv[1]), int(sys.argv[2])
    for seed, order in ((0, 0), (1, 1), (2, 2)):
        stream = StreamConfig(tasks=3, train_per_intent=train_per_intent, test_per_intent=test_per_intent,
                              heldout_per_class=2, reference_size=200, split="val", seed=seed, order=order)  # fmt: skip
        exp = Experiment(stream, log=lambda s: None)
        train = TrainConfig(epochs=2, batch_size=16, progress=False, seed=seed)
        r = {n: exp.run(n, train).agnostic for n in ("ncm", "routed-lora")}
        lead = r["routed-lora"]["last"] - r["ncm"]["last"]
        print(f"seed {seed} order {order}: routed-lora {r['routed-lora']['last']:.2f}, ncm {r['ncm']['last']:.2f}, "
              f"lead {lead:+.2f}, Banking77 change {r['routed-lora']['heldout_change']:+.2f}", flush=True)  # fmt: skip
