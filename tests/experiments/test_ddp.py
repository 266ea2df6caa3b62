"""Two processes under torchrun (gloo, CPU) train the same model as one process with
the same global batch and seed.

This file is also the torchrun worker: ``python -m torch.distributed.run
--nproc_per_node 2 test_ddp.py OUT`` trains with :func:`fit` and each rank saves its
final weights and history to ``OUT/rank<r>.pt``.
"""
import os
import subprocess
import sys
from pathlib import Path

import torch

# 27 training examples and a global batch of 8: batches of 8, 8, 8 and 3; on two ranks
# the sampler pads 27 to 28 with a repeated example, which must get weight 0. 11
# validation examples: padded too.
N_TRAIN, N_VAL, BATCH, EPOCHS, SEED = 27, 11, 8, 2, 3
# classes that FixedLogits predicts for 11 examples (padded to 12 on two ranks)
PREDICTED = [2, 0, 1, 1, 2, 0, 0, 2, 1, 1, 0]
CONFIG = dict(epochs=EPOCHS, batch_size=BATCH, lr=0.01, weight_decay=0.01, seed=SEED,
              grad_clip=1.0)


def _data():
    # the torchrun workers run this file as a script: the tests' helper modules
    # (tests/network_data.py, tests/experiments/test_train.py) are not on their path
    here = Path(__file__).resolve().parent
    for folder in (str(here), str(here.parent)):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    from test_train import sentence_trees

    trees = sentence_trees(N_TRAIN + N_VAL)
    return trees[:N_TRAIN], trees[N_TRAIN:]


def _worker(out: Path) -> None:
    import torch.distributed as dist
    from test_train import FixedLogits, fixed_logit_trees, make_model

    from hsa_graph.experiments.train import TrainConfig, evaluate, fit

    torch.set_num_threads(1)
    train, val = _data()
    model = make_model(0)
    result = fit(model, train, val, TrainConfig(checkpoint_dir=out / "ckpt", **CONFIG))
    rank = dist.get_rank()
    # each rank predicts its shard; every rank gets all of them, in data order
    predictions = evaluate(model, val, batch_size=BATCH, predictions=True)["predictions"]
    known = evaluate(FixedLogits(), fixed_logit_trees(PREDICTED), batch_size=4,
                     predictions=True)["predictions"]
    torch.save({"model": model.state_dict(), "history": result["history"],
                "best_epoch": result["best_epoch"], "world": dist.get_world_size(),
                "predictions": predictions, "known": known}, out / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_two_processes_train_the_one_process_model(tmp_path):
    from test_train import assert_same_weights, make_model

    from hsa_graph.experiments.train import TrainConfig, evaluate, fit, load_checkpoint

    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                          os.environ.get("PYTHONPATH", "")])}
    launch = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         "2", __file__, str(tmp_path)], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    # meanwhile, the one-process run (no RANK/WORLD_SIZE here: no process group)
    train, val = _data()
    model = make_model(0)
    single = fit(model, train, val, TrainConfig(**CONFIG))
    output, _ = launch.communicate(timeout=240)
    assert launch.returncode == 0, output

    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert all(r["world"] == 2 for r in ranks)
    assert_same_weights(ranks[0]["model"], ranks[1]["model"], rtol=0, atol=0)
    # float64; the summation order differs (two half-batch sums, then an all-reduce).
    # atol: the key norm's bias gets a zero gradient up to rounding (a shift of all keys
    # cancels in the softmax), which AdamW turns into ~1e-12 steps of either sign
    assert_same_weights(ranks[0]["model"], model, rtol=1e-7, atol=1e-9)
    assert ranks[0]["best_epoch"] == single["best_epoch"]
    for multi, one in zip(ranks[0]["history"], single["history"]):
        for key in ("train_loss", "val_accuracy", "val_f1", "val_loss"):
            assert abs(multi[key] - one[key]) < 1e-9, (key, multi, one)
    one_process = evaluate(model, val, batch_size=BATCH, predictions=True)["predictions"]
    assert ranks[0]["predictions"] == ranks[1]["predictions"] == one_process
    assert all(r["known"] == PREDICTED for r in ranks)
    # the weights moved (the equality is not that of two untrained models)
    assert not torch.allclose(make_model(0).lin_in.weight, model.lin_in.weight)
    # rank 0 wrote the checkpoints; they hold the last epoch's weights of both runs
    last = load_checkpoint(tmp_path / "ckpt" / "last.pt")
    assert last["epoch"] == EPOCHS and len(last["rng"]) == 2
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "best.pt", "best.pt.sha256", "last.pt", "last.pt.sha256"]


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
