"""Image sources and multi-crop augmentation for the vision tasks (SwAV).

A source is `embedded`, local image files (a folder, a file, or several, comma-separated), or
`hf:NAME` for a Hugging Face image dataset (streamed; a local image folder works too). Every
source yields float tensors [3, S, S] in [0, 1] at one size S, so a micro-batch stacks into one
tensor and kornia augments it as a whole. Each peer draws with its own seed.

The embedded default needs no download: scikit-learn's bundled copy of the "Optical Recognition
of Handwritten Digits" test set (UCI; 1,797 grayscale 8x8 images, 10 classes), which ships inside
the scikit-learn package (sklearn/datasets/data/digits.csv.gz) under scikit-learn's BSD-3-Clause
licence. The digits are upsampled to S x S and repeated to 3 channels; their labels serve only
the linear-probe evaluation, never pretraining.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Iterator

import kornia.augmentation as K
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps, UnidentifiedImageError

from collab.data import stream_hf_dataset
from collab.data.crops_config import MultiCropConfig, Scale
from collab.data.paths import HF_PREFIX, dataset_parts
from collab.errors import UserError

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff"}
# SwAV normalises every crop with the ImageNet statistics; for the gray digits they are as good as any
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def embedded_digits(image_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 digits as [N, 3, S, S] floats in [0, 1], and their labels [N]."""
    from sklearn.datasets import load_digits  # about a second to import: only the embedded source needs it

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # pixel values are 0..16
    images = F.interpolate(images, size=(image_size, image_size), mode="bilinear", align_corners=False)
    return images.clamp(0, 1).expand(-1, 3, -1, -1).contiguous(), torch.tensor(digits.target)


def image_files(spec: str) -> list[Path]:
    files: list[Path] = []
    for path in dataset_parts(spec, "image files"):
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES))
        else:
            files.append(path)
    if not files:
        raise UserError(f"dataset '{spec}' holds no image files ({', '.join(sorted(IMAGE_SUFFIXES))}); "
                        "point --dataset at a folder of images")
    return files


def to_square_tensor(image, size: int) -> torch.Tensor:
    """A PIL image as [3, size, size] in [0, 1]: shorter side resized to `size`, centre cropped."""
    square = ImageOps.fit(image.convert("RGB"), (size, size))
    return torch.from_numpy(np.asarray(square, dtype=np.uint8).copy()).permute(2, 0, 1).float() / 255.0


def shuffled_tensors(images: torch.Tensor, seed: int) -> Iterator[torch.Tensor]:
    """Endless passes over an in-memory set, each pass in a new random order."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        for index in torch.randperm(len(images), generator=generator).tolist():
            yield images[index]


def folder_images(files: list[Path], size: int, seed: int) -> Iterator[torch.Tensor]:
    """Images decoded lazily (a real folder does not fit in memory); unreadable files are skipped."""
    rng, order = random.Random(seed), list(files)
    while True:
        rng.shuffle(order)
        readable = 0
        for path in order:
            try:
                with Image.open(path) as image:
                    tensor = to_square_tensor(image, size)
            except (UnidentifiedImageError, OSError):
                continue  # one corrupt file in a large folder should not stop a volunteer's peer
            readable += 1
            yield tensor
        if not readable:
            raise UserError(f"none of the {len(files)} image files could be read (e.g. {files[0]}); "
                            "point --dataset at real images")


def streamed_images(name: str, size: int, seed: int, buffer_size: int = 1000) -> Iterator[torch.Tensor]:
    """Images from a Hugging Face dataset, streamed; the first column holding images is used."""
    dataset = stream_hf_dataset(name)  # first: a missing `datasets` package is its one-line error, not ours
    import datasets  # optional (collab[hf]): only hf: sources need it, and stream_hf_dataset has found it

    features = dataset.features or {}
    column = next((key for key, feature in features.items() if isinstance(feature, datasets.Image)), None)
    if column is None:
        raise UserError(f"dataset '{name}' has no image column (columns: {', '.join(features) or 'unknown'}); "
                        "pass an image dataset with --dataset hf:NAME")
    epoch = 0
    while True:
        images = 0
        for row in dataset.shuffle(seed=seed + epoch, buffer_size=buffer_size):
            if row.get(column) is not None:
                images += 1
                yield to_square_tensor(row[column], size)
        if images == 0:  # a whole pass gave nothing: another would not either
            raise UserError(f"dataset '{name}' has no images in its '{column}' column; pass a dataset with images "
                            "(--dataset hf:NAME)")
        epoch += 1


def image_stream(spec: str, size: int, seed: int) -> Iterator[torch.Tensor]:
    if spec == "embedded":
        return shuffled_tensors(embedded_digits(size)[0], seed)
    if spec.startswith(HF_PREFIX):
        return streamed_images(spec[len(HF_PREFIX):], size, seed)
    return folder_images(image_files(spec), size, seed)


class MultiCrop:
    """Batched kornia augmentations: random resized crop, flip, colour jitter, grayscale, blur, normalise."""

    def __init__(self, config: MultiCropConfig):
        self.config = config
        self.global_views = self._pipeline(config.global_size, config.global_scale)
        self.local_views = self._pipeline(config.local_size, config.local_scale)

    def _pipeline(self, size: int, scale: Scale):
        s = self.config.color_jitter
        blur_kernel = max(3, int(0.1 * size) // 2 * 2 + 1)  # odd, about a tenth of the crop, as in SimCLR/SwAV
        return K.AugmentationSequential(
            K.RandomResizedCrop((size, size), scale=scale),
            K.RandomHorizontalFlip(p=self.config.flip_probability),
            K.ColorJitter(0.8 * s, 0.8 * s, 0.8 * s, min(0.2 * s, 0.5), p=0.8),
            K.RandomGrayscale(p=0.2),
            K.RandomGaussianBlur(blur_kernel, sigma=(0.1, 2.0), p=self.config.blur_probability),
            K.Normalize(mean=torch.tensor(IMAGENET_MEAN), std=torch.tensor(IMAGENET_STD)),
        )

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
        """[B, 3, S, S] -> global_crops [G, B, 3, g, g] and local_crops [L, B, 3, l, l], reproducible by seed."""
        # kornia draws from torch's global generator: fork it so the crops depend on `seed` alone
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            global_crops = torch.stack([self.global_views(images) for _ in range(self.config.num_global)])
            local_crops = torch.stack([self.local_views(images) for _ in range(self.config.num_local)]) \
                if self.config.num_local else images.new_zeros((0, len(images), 3, self.config.local_size,
                                                                 self.config.local_size))
        return {"global_crops": global_crops, "local_crops": local_crops}
