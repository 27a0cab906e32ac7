"""Before Qt starts: can it open a window here? One line naming what is missing, instead of Qt's abort.

Qt's xcb platform (X11) aborts the process (exit 134) when a library it needs is missing, and its
message names only the first one it tried (often libxcb-cursor0, even when that one is installed).
We ask the dynamic loader instead: ``ldd`` on Qt's GUI library and its xcb plugin lists every
library that will not be found, and libxcb-cursor (which Qt loads later, by name) is looked up
with ``ctypes.util.find_library``. No Qt is imported here.
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

# soname → (Debian/Ubuntu package, Fedora/RHEL package)
PACKAGES = {
    "libxcb-cursor.so.0": ("libxcb-cursor0", "xcb-util-cursor"),
    "libxcb-icccm.so.4": ("libxcb-icccm4", "xcb-util-wm"),
    "libxcb-keysyms.so.1": ("libxcb-keysyms1", "xcb-util-keysyms"),
    "libxcb-image.so.0": ("libxcb-image0", "xcb-util-image"),
    "libxcb-render-util.so.0": ("libxcb-render-util0", "xcb-util-renderutil"),
    "libxcb-util.so.1": ("libxcb-util1", "xcb-util"),
    "libxcb-shape.so.0": ("libxcb-shape0", "libxcb"),
    "libxcb-xkb.so.1": ("libxcb-xkb1", "libxcb"),
    "libxcb-randr.so.0": ("libxcb-randr0", "libxcb"),
    "libxcb-xfixes.so.0": ("libxcb-xfixes0", "libxcb"),
    "libxcb-sync.so.1": ("libxcb-sync1", "libxcb"),
    "libxcb-shm.so.0": ("libxcb-shm0", "libxcb"),
    "libxcb-render.so.0": ("libxcb-render0", "libxcb"),
    "libxcb-xinput.so.0": ("libxcb-xinput0", "libxcb"),
    "libxcb.so.1": ("libxcb1", "libxcb"),
    "libxkbcommon-x11.so.0": ("libxkbcommon-x11-0", "libxkbcommon-x11"),
    "libxkbcommon.so.0": ("libxkbcommon0", "libxkbcommon"),
    "libX11-xcb.so.1": ("libx11-xcb1", "libX11-xcb"),
    "libX11.so.6": ("libx11-6", "libX11"),
    "libEGL.so.1": ("libegl1", "libglvnd-egl"),
    "libGL.so.1": ("libgl1", "libglvnd-glx"),
    "libOpenGL.so.0": ("libopengl0", "libglvnd-opengl"),
    "libfontconfig.so.1": ("libfontconfig1", "fontconfig"),
    "libfreetype.so.6": ("libfreetype6", "freetype"),
    "libdbus-1.so.3": ("libdbus-1-3", "dbus-libs"),
    "libglib-2.0.so.0": ("libglib2.0-0", "glib2"),
    "libSM.so.6": ("libsm6", "libSM"),
    "libICE.so.6": ("libice6", "libICE"),
}
NO_DISPLAY = "no display: use `multilane train`, or set QT_QPA_PLATFORM=offscreen"


def parse_ldd(text: str) -> list[str]:
    """The sonames ``ldd`` reports as ``not found``, once each, in order."""
    missing: list[str] = []
    for line in text.splitlines():
        name, sep, where = line.strip().partition("=>")
        if sep and where.strip() == "not found" and name.strip() not in missing:
            missing.append(name.strip())
    return missing


def _qt_files() -> list[Path]:
    spec = importlib.util.find_spec("PySide6")
    if spec is None or not spec.submodule_search_locations:
        return []
    root = Path(next(iter(spec.submodule_search_locations))) / "Qt"
    return [p for p in (root / "lib/libQt6Gui.so.6", root / "plugins/platforms/libqxcb.so") if p.exists()]


def missing_libraries(files: list[Path] | None = None) -> list[str]:
    """Sonames Qt's window system needs here and the loader cannot find."""
    ldd = shutil.which("ldd")
    missing: list[str] = []
    if ldd is not None:
        for f in files if files is not None else _qt_files():
            try:
                out = subprocess.run([ldd, str(f)], capture_output=True, text=True, timeout=20).stdout
            except (OSError, subprocess.SubprocessError):
                continue
            missing += [m for m in parse_ldd(out) if m not in missing]
    if files is None and ctypes.util.find_library("xcb-cursor") is None:
        missing.append("libxcb-cursor.so.0")  # Qt 6.5+ opens it by name at start, not through the linker
    return missing


def install_hint(missing: list[str]) -> str:
    """The command that installs these libraries on this kind of system."""
    column = 1 if shutil.which("dnf") and not shutil.which("apt-get") else 0
    packages: list[str] = []
    for soname in missing:
        pkg = PACKAGES.get(soname, (soname, soname))[column]
        if pkg not in packages:
            packages.append(pkg)
    tool = "dnf install -y" if column else "apt-get install -y"
    return f"sudo {tool} {' '.join(packages)}"


def window_problem(env: dict[str, str] | None = None) -> str | None:
    """One line saying why the app cannot open a window here, or None when it can (or cannot tell)."""
    env = dict(os.environ if env is None else env)
    if not sys.platform.startswith("linux"):
        return None
    platform = env.get("QT_QPA_PLATFORM", "").split(":")[0]
    if platform and platform != "xcb":
        return None  # offscreen, wayland, vnc...: not ours to judge
    if not platform and env.get("WAYLAND_DISPLAY"):
        return None
    if importlib.util.find_spec("PySide6") is None:
        return None  # the app's import says what to install
    if not env.get("DISPLAY"):
        return NO_DISPLAY
    missing = missing_libraries()
    if missing:
        return (
            f"the app cannot open a window: missing system libraries {', '.join(missing)}; "
            f"install them with: {install_hint(missing)}"
        )
    return None
