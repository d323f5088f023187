"""SwAV: Sinkhorn-Knopp, multi-crop, frozen prototypes, queue, checkpoints, image sources, config
errors, the quality of what it learns (a linear probe), and a real 2-peer collaborative run."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import yaml
from transformers import ResNetModel

from collab.config import RunConfig, load_config, shipped_config
from collab.data.images import IMAGENET_MEAN, IMAGENET_STD, embedded_digits, image_stream, shuffled_tensors
from collab.errors import UserError
from collab.tasks import build_task
from collab.tasks.swav import HEAD_FILE, SwavTask, sinkhorn_knopp

TINY = load_config("swav-tiny").model_dump(mode="json")


def tiny_task(**changes) -> SwavTask:
    """The swav-tiny config with dotted-key `changes`."""
    data = copy.deepcopy(TINY)
    for dotted, value in changes.items():
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node[key]
        node[leaf] = value

    return build_task(RunConfig.model_validate(data))


def test_sinkhorn_knopp_is_a_balanced_assignment():
    torch.manual_seed(0)
    batch, prototypes = 64, 100
    scores = torch.nn.functional.normalize(torch.randn(batch, 32), dim=1) @ \
        torch.nn.functional.normalize(torch.randn(prototypes, 32), dim=1).t()
    codes = sinkhorn_knopp(scores, epsilon=0.05, iterations=3)
    assert codes.shape == (batch, prototypes) and (codes >= 0).all()
    # each sample's codes are a distribution: the last normalisation makes this exact
    torch.testing.assert_close(codes.sum(dim=1), torch.ones(batch))
    # every prototype gets an equal share of the batch (B/K): SwAV's 3 iterations come close (measured:
    # 2% off on average, 22% at worst, against 5x for the plain softmax), more iterations converge
    imbalance = (codes.sum(dim=0) / (batch / prototypes) - 1).abs()
    assert imbalance.mean() < 0.05 and imbalance.max() < 0.3, imbalance
    softmax = torch.softmax(scores / 0.05, dim=1).sum(dim=0) / (batch / prototypes)
    assert (softmax - 1).abs().max() > 1
    converged = sinkhorn_knopp(scores, epsilon=0.05, iterations=200)
    torch.testing.assert_close(converged.sum(dim=0), torch.full((prototypes,), batch / prototypes), atol=1e-3, rtol=0)
    # and it follows the scores: the best-scoring prototype of a sample gets more than a uniform share
    best = scores.argmax(dim=1)
    assert codes[torch.arange(batch), best].mean() > 3 / prototypes
    # a small epsilon neither overflows nor underflows: exp(-2 / 0.001) is 0 in float32
    sharp = sinkhorn_knopp(scores, epsilon=0.001, iterations=3)
    assert torch.isfinite(sharp).all()
    torch.testing.assert_close(sharp.sum(dim=1), torch.ones(batch))


def test_multicrop_batches_have_the_configured_views_and_follow_the_seed():
    task = tiny_task()
    batch = next(task.batches(8, seed=1))
    assert batch["global_crops"].shape == (2, 8, 3, 32, 32)
    assert batch["local_crops"].shape == (4, 8, 3, 16, 16)
    assert not torch.equal(batch["global_crops"][0], batch["global_crops"][1])  # two different views
    again = next(tiny_task().batches(8, seed=1))
    assert torch.equal(batch["global_crops"], again["global_crops"])  # reproducible ...
    other = next(task.batches(8, seed=2))
    assert not torch.equal(batch["global_crops"], other["global_crops"])  # ... and each peer its own order
    loss = task.loss(batch)
    assert torch.isfinite(loss) and loss.item() > 0


def _lars_step(task: SwavTask, step: int, batch) -> None:
    optimizer = task.optimizer_factory()(task.parameter_groups())
    task.set_step(step)
    task.loss(batch).backward()
    optimizer.step()
    task.model.zero_grad(set_to_none=True)


def test_prototypes_are_frozen_for_the_first_steps():
    task = tiny_task(**{"task.loss.freeze_prototypes_steps": 3})
    batch = next(task.batches(16, seed=0))
    before = task.model.normalized_prototypes().detach().clone()
    stem = task.model.backbone.embedder.embedder.convolution.weight.detach().clone()
    _lars_step(task, 2, batch)
    assert not torch.equal(stem, task.model.backbone.embedder.embedder.convolution.weight)  # the rest learns
    # weight decay may rescale the rows; the directions, all the model uses, do not move
    torch.testing.assert_close(task.model.normalized_prototypes(), before)
    _lars_step(task, 3, batch)
    assert (task.model.normalized_prototypes() - before).abs().max() > 1e-4


def test_queue_starts_at_its_step_and_joins_sinkhorn_once_full():
    task = tiny_task(**{"task.loss.queue_length": 32, "task.loss.queue_start_step": 2})
    batches = task.batches(16, seed=0)
    task.set_step(1)
    task.loss(next(batches))
    assert task.queue is None
    task.set_step(2)
    first = next(batches)
    task.loss(first)
    assert task.queue.shape == (2, 32, 32) and task.queued == 16
    task.loss(next(batches))
    assert task.queued == 32  # full: from now on Sinkhorn balances 16 + 32 rows
    with torch.no_grad():
        embeddings, scores = task.model([first["global_crops"], first["local_crops"]])
    with_queue = task._codes(0, scores[:16])
    task.queue = None
    assert not torch.allclose(with_queue, task._codes(0, scores[:16]))


def test_checkpoint_backbone_loads_with_from_pretrained(tmp_path):
    task = tiny_task()
    _lars_step(task, 100, next(task.batches(8, seed=0)))
    task.save_pretrained(tmp_path)
    assert (tmp_path / "config.json").is_file() and (tmp_path / HEAD_FILE).is_file()
    backbone = ResNetModel.from_pretrained(tmp_path)
    for name, value in task.model.backbone.state_dict().items():
        torch.testing.assert_close(backbone.state_dict()[name], value, msg=name)
    fresh = tiny_task(**{"training.seed": 7})
    fresh.load_pretrained(tmp_path)
    for name, value in task.model.state_dict().items():
        torch.testing.assert_close(fresh.model.state_dict()[name], value, msg=name)


def test_image_folder_source(tmp_path):
    from PIL import Image

    folder = tmp_path / "images" / "nested"
    folder.mkdir(parents=True)
    Image.new("RGB", (40, 30), (255, 0, 0)).save(folder / "red.png")
    Image.new("L", (20, 50), 128).save(folder / "gray.jpg")
    (folder / "broken.png").write_bytes(b"not a png")  # skipped, not fatal
    (folder / "notes.txt").write_text("ignored")
    images = image_stream(str(tmp_path / "images"), 24, seed=0)
    seen = [next(images) for _ in range(6)]
    assert all(image.shape == (3, 24, 24) and 0 <= image.min() and image.max() <= 1 for image in seen)
    assert any(torch.allclose(image[0], torch.ones(24, 24)) and image[1].max() < 0.01 for image in seen)  # red
    with pytest.raises(UserError, match="does not exist"):
        next(image_stream(str(tmp_path / "missing"), 24, seed=0))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds no image files"):
        next(image_stream(str(tmp_path / "empty"), 24, seed=0))


def test_hugging_face_image_dataset_path_on_local_files(tmp_path):
    """hf: is what real runs use (streaming load_dataset); here it reads a local image folder."""
    from PIL import Image

    for i in range(4):
        Image.new("RGB", (16, 16), (60 * i, 0, 0)).save(tmp_path / f"{i}.png")
    images = image_stream(f"hf:{tmp_path}", 8, seed=0)
    assert next(images).shape == (3, 8, 8)
    with pytest.raises(UserError, match="cannot load dataset"):
        next(image_stream(f"hf:{tmp_path / 'missing'}", 8, seed=0))


def test_shipped_swav_configs_build():
    assert load_config("swav-tiny").task.name == "swav"
    big = load_config("swav-resnet50")
    assert big.task.model.hidden_sizes[-1] == 2048 and big.task.crops.num_local == 6


@pytest.mark.parametrize("changes, expected", [
    ({"loss": {"temperature": 0}}, "task.loss.temperature: input should be greater than 0, got 0"),
    ({"model": {"depths": [1, 1]}}, "hidden_sizes has 4 stages but depths has 2"),
    ({"crops": {"local_scale": [0.5, 0.1]}}, "local_scale (0.5, 0.1) must satisfy 0 < low <= high <= 1"),
    ({"crops": {"num_global": 1, "num_local": 0}}, "swapped prediction needs at least 2 crops"),
    ({"data": {"datset": "x"}}, "unknown key 'task.data.datset'; remove it or correct it (did you mean 'dataset'?)"),
    ({"losss": {}}, "unknown key 'task.losss'; remove it or correct it (did you mean 'loss'?)"),
    ({"model": {"layer_type": "wide"}}, "task.model.layer_type: input should be 'basic' or 'bottleneck'"),
])
def test_bad_swav_config_names_the_field(tmp_path, changes, expected):
    data = yaml.safe_load(shipped_config("swav-tiny").read_text())
    for section, values in changes.items():
        data["task"].setdefault(section, {}).update(values)
    path = tmp_path / "swav.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(UserError) as error:
        load_config(path)
    message = str(error.value)
    assert expected in message and "\n" not in message, message


def _probe_accuracy(model, images, labels, train, test) -> float:
    """Logistic regression on the backbone's pooled features of clean images (BatchNorm in eval mode)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    model.eval()
    with torch.no_grad():
        features = model.features((images - mean) / std).numpy()
    model.train()
    probe = make_pipeline(StandardScaler(), LogisticRegression(max_iter=3000))
    probe.fit(features[train], labels[train])
    return probe.score(features[test], labels[test])


# Measured on 2 cores (swav-tiny, one torch thread, 400 steps of 64 images, ~45 s of pretraining): random backbone
# 0.907, SwAV backbone 0.933 and 0.940 (seeds 0 and 1). At 150 steps the margin was float-rounding noise: -0.004 to
# +0.035 across seeds, and +0.006 or +0.032 for one seed under one torch thread or two. With SwAV's full photometric
# augmentations (flips, strong jitter, blur) this probe gave no better than random features, which is why swav-tiny
# turns them down for the digits; a loss or optimizer that does not learn lands there too.
PROBE_STEPS = 400
PROBE_MARGIN = 0.01


@pytest.mark.long
def test_swav_features_beat_random_features_in_a_linear_probe():
    """Quality, not only motion: pretrain in-process (the task's own loss, LARS and schedule; no swarm)
    on 60% of the digits without labels, then probe with labels on the held-out 40%."""
    from sklearn.model_selection import train_test_split

    task = tiny_task(**{"training.total_steps": PROBE_STEPS})
    images, labels = embedded_digits(32)
    labels = labels.numpy()
    train, test = train_test_split(range(len(labels)), test_size=0.4, random_state=0, stratify=labels)
    random_accuracy = _probe_accuracy(task.model, images, labels, train, test)

    optimizer = task.optimizer_factory()(task.parameter_groups())
    schedule = task.scheduler_factory()(optimizer)
    batches = task.multicrop_batches(shuffled_tensors(images[train], seed=0), 64, seed=0)
    started, losses = time.monotonic(), []
    for step in range(PROBE_STEPS):  # one optimizer step per micro-batch, as a lone peer with target = micro
        task.set_step(step)
        loss = task.loss(next(batches))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        losses.append(loss.item())
    seconds = time.monotonic() - started
    swav_accuracy = _probe_accuracy(task.model, images, labels, train, test)
    margin = swav_accuracy - random_accuracy
    print(f"\nlinear probe on held-out digits: random backbone {random_accuracy:.3f}, SwAV backbone "
          f"{swav_accuracy:.3f}, margin {margin:+.3f}; loss {losses[0]:.3f} -> {sum(losses[-10:]) / 10:.3f} "
          f"in {PROBE_STEPS} steps, {seconds:.0f} s")
    assert sum(losses[-10:]) / 10 < losses[0] - 1.0
    assert margin > PROBE_MARGIN, f"SwAV features are not better than random ones (margin {margin:+.3f})"

