"""``imagefolder``: images in one subfolder per class, read by torchvision's ImageFolder, a ResNet, accuracy.

Needs the ``[vision]`` extra (torchvision). The layout is torchvision's: ``root/<class>/<image>``; or
``root/train/<class>/...`` with ``root/val/<class>/...`` for a validation set of its own (then the
engine does not split, and augmentation touches only the training images).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Literal

import torch
from multilane.engine.errors import UserError
from multilane.engine.rundir.readfile import user_path
from multilane.engine.tasks.base import Task
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from torch.nn import functional as F

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def vision_install_hint() -> str:
    """The install line, naming the torch installed now: pip then keeps it (docs/install.md: a bare torch
    requirement may pull another, multi-GB build) and picks the torchvision made for it."""
    import torch

    version = torch.__version__.split("+")[0]  # "==2.13.0" matches a local build (2.13.0+cu126) too
    return (
        f'install the vision extra, naming your torch in the same call: pip install "torch=={version}" -e ".[vision]"'
    )


def torchvision_or_hint() -> Any:
    """Import torchvision, or a UserError naming the extra that installs it."""
    try:
        import torchvision
    except ImportError:
        raise UserError(
            f"task imagefolder: needs torchvision, which is not installed; {vision_install_hint()}"
        ) from None
    except RuntimeError as e:
        if "torchvision::nms" not in str(e):
            raise
        torchvision = _import_without_compiled_ops()
    return torchvision


_FRAGMENT: Any = None


def _import_without_compiled_ops() -> Any:
    """Import a torchvision whose compiled ops do not load into this torch.

    PyPI's torchvision 0.28.0 for Linux is built against the CUDA torch 2.13.0; with the CPU build of
    torch its ``_C`` library cannot load, and its import then fails on the first op it registers a fake
    kernel for (``torchvision::nms``, the only one torchvision does not guard). Defining those two op
    schemas lets the import finish: datasets, transforms (PIL) and models are Python and torch only;
    detection ops (nms, roi_align, ...) stay unusable, and this task uses none of them.
    """
    global _FRAGMENT
    import sys

    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    if _FRAGMENT is None:
        _FRAGMENT = torch.library.Library("torchvision", "FRAGMENT")
        _FRAGMENT.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _FRAGMENT.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    import torchvision

    return torchvision


class ImageFolderParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    root: str = Field(
        "",
        description="Folder with one subfolder of images per class (or train/ and val/ folders of such)",
        json_schema_extra={"picker": "folder"},
    )
    arch: Literal["resnet18", "resnet34", "resnet50"] = Field(
        "resnet18", description="torchvision ResNet, trained from scratch (no pretrained weights)"
    )
    image_size: int = Field(64, ge=8, le=1024, description="Images are resized to this many pixels square")
    small_images: bool = Field(
        True, description="CIFAR-style stem for small images: a 3x3 first convolution, no max-pool"
    )
    augment: bool = Field(
        False, description="Random crops and flips of the training images (needs root/train and root/val)"
    )


class ImageFolderTask(Task):
    """A torchvision ResNet on a folder of images, one subfolder per class."""

    name = "imagefolder"
    description = "torchvision ResNet on a folder of images (one subfolder per class), accuracy; needs [vision]"
    Params = ImageFolderParams
    metric = "accuracy"

    def __init__(self, params: BaseModel | None = None) -> None:
        super().__init__(params)
        self._classes: int | None = None
        self.warnings: list[str] = []  # said once the run starts (a warning event in metrics.jsonl)

    def _folders(self) -> tuple[Path, Path | None]:
        p = self.params
        if not p.root:
            raise UserError("task imagefolder: set task.params.root to a folder of images (one subfolder per class)")
        root = user_path(p.root, "task imagefolder: task.params.root")
        if not root.is_dir():
            raise UserError(f"task imagefolder: root = {p.root!r}: no such folder")
        if (root / "train").is_dir() and (root / "val").is_dir():
            return root / "train", root / "val"
        if p.augment:
            raise UserError(
                "task imagefolder: augment needs root/train and root/val folders "
                "(a validation set held out of one folder would be augmented too)"
            )
        return root, None

    def _transform(self, train: bool) -> Any:
        tv = torchvision_or_hint()
        t, s = tv.transforms, self.params.image_size
        steps = [t.RandomResizedCrop(s, scale=(0.6, 1.0)), t.RandomHorizontalFlip()] if train else [t.Resize((s, s))]
        return t.Compose([*steps, t.ToTensor(), t.Normalize(IMAGENET_MEAN, IMAGENET_STD)])

    def _dataset(self, folder: Path, train: bool) -> Any:
        tv = torchvision_or_hint()
        skipped: list[str] = []

        class Folder(tv.datasets.ImageFolder):
            @staticmethod
            def make_dataset(directory: str, class_to_idx: dict[str, int], *args: Any, **kw: Any) -> list:
                samples, skips = scan_images(Path(directory), class_to_idx, tv.datasets.folder.IMG_EXTENSIONS)
                skipped.extend(skips)
                if not samples:
                    raise FileNotFoundError(f"no images found in {directory}")
                empty = empty_classes(samples, class_to_idx)
                if empty:  # the model would learn a class it can never see (torchvision refuses it too)
                    first = Path(directory) / empty[0]
                    more = f" (and {len(empty) - 1} other class folder(s))" if len(empty) > 1 else ""
                    raise UserError(
                        f"task imagefolder: class folder {first}{more} holds no image that can be read; "
                        "add images or remove the folder"
                    )
                return samples

        try:
            dataset = Folder(str(folder), transform=self._transform(train and self.params.augment))
        except (FileNotFoundError, OSError) as e:
            raise UserError(f"task imagefolder: {folder}: {e}") from None
        if skipped:
            self.warnings.append(
                f"imagefolder: {folder}: {len(skipped)} entr{'y' if len(skipped) == 1 else 'ies'} skipped "
                f"(not a regular image file, a symlink out of the folder, or a loop), e.g. {skipped[0]}"
            )
        return dataset

    def num_classes(self) -> int:
        if self._classes is None:
            train, _ = self._folders()
            classes = [d for d in train.iterdir() if d.is_dir()]
            if len(classes) < 2:
                raise UserError(f"task imagefolder: {train}: needs at least 2 class subfolders, found {len(classes)}")
            self._classes = len(classes)
        return self._classes

    def build_model(self) -> nn.Module:
        tv = torchvision_or_hint()
        model = tv.models.get_model(self.params.arch, weights=None, num_classes=self.num_classes())
        if self.params.small_images:
            model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
            model.maxpool = nn.Identity()
        return model

    def data(self) -> Any:
        train_dir, val_dir = self._folders()
        train = self._dataset(train_dir, train=True)
        if val_dir is None:
            return train
        return train, self._dataset(val_dir, train=False)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target)

    def metrics(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"accuracy": (output.argmax(dim=-1) == target).float().mean()}


def scan_images(
    folder: Path, class_to_idx: dict[str, int], extensions: tuple[str, ...]
) -> tuple[list[tuple[str, int]], list[str]]:
    """``(path, class)`` for every image under ``folder/<class>/``, and what was skipped.

    torchvision's own walk follows every symlink: a link back up (``cat/loop -> ..``) repeats the
    folder dozens of times (48 images became 1,968 samples, and training and validation overlapped),
    and a FIFO named ``x.png`` blocks a worker for ever. Here a folder is visited once (by its real
    path), no symlink leads out of ``folder``, each file is taken once, and only a regular file is an
    image: FIFOs, devices and sockets are skipped (never opened).
    """
    root = os.path.realpath(folder)
    samples: list[tuple[str, int]] = []
    skipped: list[str] = []
    seen_dirs: set[str] = set()
    seen_files: set[tuple[int, int]] = set()
    for name in sorted(class_to_idx):
        top = os.path.join(folder, name)
        home = os.path.realpath(top)  # a class's images stay in its own folder (a link to another class's is not its)
        if not _inside(home, root):
            skipped.append(top)
            continue
        stack = [top]
        while stack:
            here = stack.pop()
            real = os.path.realpath(here)
            if real in seen_dirs or not _inside(real, home):
                skipped.append(here)
                continue
            seen_dirs.add(real)
            try:
                entries = sorted(os.scandir(here), key=lambda e: e.name)
            except OSError:
                skipped.append(here)
                continue
            subdirs = []
            for entry in entries:
                try:
                    st = os.stat(entry.path)  # through a symlink: what it names
                except OSError:  # a dangling link, a loop of links
                    skipped.append(entry.path)
                    continue
                if stat.S_ISDIR(st.st_mode):
                    subdirs.append(entry.path)
                elif not entry.name.lower().endswith(extensions):
                    continue  # not an image by its name: not counted, as torchvision does
                elif (
                    not stat.S_ISREG(st.st_mode)
                    or not _inside(os.path.realpath(entry.path), home)
                    or (st.st_dev, st.st_ino) in seen_files
                ):
                    skipped.append(entry.path)
                else:
                    seen_files.add((st.st_dev, st.st_ino))
                    samples.append((entry.path, class_to_idx[name]))
            stack.extend(reversed(subdirs))
    return samples, skipped


def empty_classes(samples: list[tuple[str, int]], class_to_idx: dict[str, int]) -> list[str]:
    """The classes (folder names, sorted) that no sample belongs to."""
    seen = {c for _, c in samples}
    return [name for name, idx in sorted(class_to_idx.items()) if idx not in seen]


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)
