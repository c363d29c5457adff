"""Load an optimised BLAS for MLX's CPU backend, before MLX is imported.

Why: the Linux `mlx-cpu` wheel bundles the reference (netlib) BLAS, and MLX's CPU matmul calls
`cblas_sgemm`. `libmlx.so` binds that symbol when it is loaded, searching the process's global
symbols first, so a library exporting `cblas_sgemm` that was opened with RTLD_GLOBAL *before*
`import mlx.core` replaces the reference one: a 512x4096x4096 float32 matmul goes from ~7.3 s to
~90 ms on two cores with Debian's OpenBLAS. Loading it after `mlx.core` was imported does nothing
(measured: the symbol stays bound to the bundled library, even before the first matmul).

This module therefore imports nothing from MLX. The CLI's very first action must be:

    from chatapp.backend.blas import preload_blas
    preload_blas(setting)          # "auto" (default), "off", or a path to a .so

Which libraries work: any that exports the *standard, unprefixed* CBLAS symbol `cblas_sgemm`.
Checked with `nm -D` (OpenBLAS 0.3.21-0.3.34, x86_64):
- Debian/Ubuntu `libopenblas0-pthread` (`/usr/lib/<multiarch>/openblas-pthread/libopenblas.so.0`): works, best.
- PyPI `ngsolve-openblas` (libopenblasp-r0.3.33.so) and `cmeel-openblas` (cmeel.prefix/lib/libopenblas.so.0):
  unprefixed, work, but both need the system's `libgfortran.so.5` (not bundled).
- PyPI `scipy-openblas32` / `scipy-openblas64` and numpy's bundled OpenBLAS: symbols are prefixed
  (`scipy_cblas_sgemm`, `scipy_cblas_sgemm64_`), so MLX cannot use them; verification rejects them.

Threads: MLX's CPU ops run on one thread (its stream's), and OpenBLAS's sgemm runs on the calling
thread plus its own workers, so OpenBLAS's default (one thread per core) does not oversubscribe:
with OPENBLAS_NUM_THREADS=1 a 512-token dense matmul takes twice as long on two cores. chatapp
leaves OPENBLAS_NUM_THREADS to the user and reports the thread count OpenBLAS chose.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import os
import platform
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

SYMBOL = "cblas_sgemm"
INSTALL_HINT = (
    "optional, chatapp's CPU kernels need none (it speeds up only products MLX runs itself): "
    "install an optimised BLAS: `sudo apt-get install libopenblas0-pthread` (Debian/Ubuntu), "
    "`sudo dnf install openblas-threads` (Fedora), `sudo pacman -S openblas` (Arch); or "
    "`pip install ngsolve-openblas` (needs the system's libgfortran.so.5); or point the `blas` "
    "setting at a libopenblas.so that exports cblas_sgemm"
)
# Symbols of builds that rename CBLAS (numpy's and scipy-openblas's): present means "wrong build".
_PREFIXED = ("scipy_cblas_sgemm", "scipy_cblas_sgemm64_", "cblas_sgemm64_")


@dataclass
class BlasInfo:
    """What `preload_blas` did. `loaded` is True when MLX will use `path` for cblas_sgemm."""

    name: str
    path: str | None
    loaded: bool
    reason: str
    threads: int | None = None
    tried: list[str] = field(default_factory=list)

    def summary(self) -> str:
        if self.loaded:
            t = f", {self.threads} threads" if self.threads else ""
            return f"BLAS: {self.name} ({self.path}{t})"
        return f"BLAS: MLX's bundled reference BLAS (slow) - {self.reason}"

    def describe(self) -> str:
        """One line for logs and --verbose (the same as `summary`)."""
        return self.summary()


_current: BlasInfo | None = None


def preload_blas(setting: str = "auto") -> BlasInfo:
    """Load an optimised BLAS globally so that MLX binds `cblas_sgemm` to it.

    setting: "auto" searches the usual places (see `candidate_paths`), "off" loads nothing, any
    other value is the path of a shared library to load. Must run before `import mlx.core`;
    afterwards it reports that it is too late and loads nothing. Calling it again after a
    successful load returns the first result.
    """
    global _current
    if _current is not None and _current.loaded:
        return _current
    info = _preload(str(setting).strip() or "auto")
    _current = info
    return info


def current_blas() -> BlasInfo:
    """The BLAS MLX uses in this process, as far as can be told.

    The result of `preload_blas` when it ran; otherwise whichever library provides a global
    `cblas_sgemm` (for example one given with LD_PRELOAD), else the bundled reference BLAS.
    """
    if _current is not None and _current.loaded:
        return _current
    owner = active_blas()
    if owner:
        return _describe_global(owner)
    if _current is not None:
        return _current
    return BlasInfo("reference", None, False, "preload_blas() did not run before mlx.core was imported")


def active_blas() -> str | None:
    """Path of the library that provides `cblas_sgemm` in the process's global symbol scope.

    MLX's bundled BLAS is loaded privately (RTLD_LOCAL), so it never shows up here: a result
    means an optimised BLAS was made global (by `preload_blas`, LD_PRELOAD or another loader).
    """
    try:
        glob_scope = ctypes.CDLL(None)
        fn = getattr(glob_scope, SYMBOL)
    except (OSError, AttributeError):
        return None
    return _dladdr_path(ctypes.cast(fn, ctypes.c_void_p).value)


def candidate_paths() -> list[tuple[str, str]]:
    """(label, path or soname) of the optimised BLAS libraries "auto" tries, in order."""
    ma = sysconfig.get_config_var("MULTIARCH") or f"{platform.machine()}-linux-gnu"
    deb = f"/usr/lib/{ma}"
    out: list[tuple[str, str]] = [
        ("Debian/Ubuntu libopenblas0-pthread", f"{deb}/openblas-pthread/libopenblas.so.0"),
        ("Debian/Ubuntu libopenblas0-openmp", f"{deb}/openblas-openmp/libopenblas.so.0"),
        ("Debian/Ubuntu libopenblas.so.0 alternative", f"{deb}/libopenblas.so.0"),
        ("Fedora openblas-threads", "/usr/lib64/libopenblasp.so.0"),
        ("Fedora openblas-openmp", "/usr/lib64/libopenblaso.so.0"),
        ("Fedora openblas", "/usr/lib64/libopenblas.so.0"),
        ("Arch/generic openblas", "/usr/lib/libopenblas.so.0"),
        ("Alpine openblas", "/usr/lib/libopenblas.so.3"),
        ("/usr/local build", "/usr/local/lib/libopenblas.so.0"),
        ("OpenBLAS make install", "/opt/OpenBLAS/lib/libopenblas.so.0"),
        ("Homebrew on Linux", "/home/linuxbrew/.linuxbrew/opt/openblas/lib/libopenblas.so.0"),
    ]
    for prefix in dict.fromkeys(p for p in (sys.prefix, os.environ.get("CONDA_PREFIX")) if p):
        out.append(("conda/venv prefix", str(Path(prefix) / "lib" / "libopenblas.so.0")))
    found = ctypes.util.find_library("openblas")
    if found:
        out.append(("ldconfig (find_library)", found))
    out.append(("Debian/Ubuntu libopenblas0-serial (single-threaded)", f"{deb}/openblas-serial/libopenblas.so.0"))
    out.extend(_pypi_candidates())
    seen: set[str] = set()
    unique = []
    for label, path in out:
        key = os.path.realpath(path) if os.path.isabs(path) else path
        if key not in seen:
            seen.add(key)
            unique.append((label, path))
    return unique


def verify_blas(path: str) -> tuple[bool, str]:
    """Open `path` privately and check that it exports the unprefixed `cblas_sgemm`.

    Returns (ok, why). Nothing is made global, so a wrong library does no harm.
    """
    try:
        lib = _dlopen(path, os.RTLD_LOCAL)
    except OSError as e:
        return False, f"cannot be loaded: {e}"
    try:
        getattr(lib, SYMBOL)
    except AttributeError:
        prefixed = [p for p in _PREFIXED if _has(lib, p)]
        if prefixed:
            return False, f"exports {prefixed[0]} but not {SYMBOL}: a symbol-prefixed build MLX cannot use"
        return False, f"does not export {SYMBOL}"
    return True, f"exports {SYMBOL}"


def probe_blas(setting: str = "auto") -> str:
    """What ``preload_blas(setting)`` would load, found without loading anything globally
    (for --show-config, which imports no MLX)."""
    if not sys.platform.startswith("linux"):
        return f"not needed on {sys.platform}: MLX uses the platform's own BLAS"
    setting = str(setting).strip() or "auto"
    if setting.lower() == "off":
        return "off: MLX's own dense products use its bundled reference BLAS"
    paths = [(label, p) for label, p in candidate_paths()] if setting.lower() == "auto" else [("cpu.blas", setting)]
    for label, path in paths:
        if os.path.isabs(path) and not os.path.exists(path):
            continue
        if verify_blas(path)[0]:
            return f"{path} ({label}) for MLX's own dense products"
    return ("none found: MLX's own dense products use its bundled reference BLAS (chatapp's CPU kernels "
            "and numpy's bundled OpenBLAS do the heavy products without one)")


# --- internals -------------------------------------------------------------------------------


def _preload(setting: str) -> BlasInfo:
    if not sys.platform.startswith("linux"):
        return BlasInfo("none", None, False, f"not needed on {sys.platform}: MLX uses the platform's own BLAS there")
    if setting.lower() == "off":
        return BlasInfo("none", None, False, "the blas setting is 'off': MLX uses its bundled reference BLAS")
    if _mlx_imported():
        owner = active_blas()
        extra = (f" (a global {SYMBOL} from {owner} is present: MLX uses it only if it was loaded first)"
                 if owner else "")
        return BlasInfo(
            "none", None, False,
            "too late: mlx.core was imported before preload_blas(), so MLX is already bound to its "
            f"bundled reference BLAS; call preload_blas() before anything imports mlx{extra}",
        )
    if setting.lower() == "auto":
        tried = []
        for label, path in candidate_paths():
            if os.path.isabs(path) and not os.path.exists(path):
                continue
            ok, why = verify_blas(path)
            if not ok:
                tried.append(f"{path} ({label}): {why}")
                continue
            info = _load_global(path, f"found {label}")
            info.tried = tried
            if info.loaded:
                return info
            tried.append(f"{path} ({label}): {info.reason}")
        where = "; ".join(tried) if tried else "none of the usual paths exist"
        return BlasInfo("none", None, False, f"no optimised BLAS found ({where}); {INSTALL_HINT}", tried=tried)
    path = os.path.expanduser(setting)
    if not os.path.exists(path):
        return BlasInfo("none", path, False, f"{path} does not exist; {INSTALL_HINT}")
    ok, why = verify_blas(path)
    if not ok:
        return BlasInfo("none", path, False, f"{path} {why}; {INSTALL_HINT}")
    return _load_global(path, "from the blas setting")


def _load_global(path: str, how: str) -> BlasInfo:
    try:
        lib = _dlopen(path, os.RTLD_GLOBAL)
    except OSError as e:  # verified a moment ago, so unlikely
        return BlasInfo("none", path, False, f"cannot be loaded globally: {e}")
    name, threads = _identify(lib)
    resolved = _real(_dladdr_path(ctypes.cast(getattr(lib, SYMBOL), ctypes.c_void_p).value) or path)
    owner = active_blas()
    if owner is None:
        return BlasInfo(name, path, False, f"loaded, but {SYMBOL} did not become global")
    if _real(owner) != resolved:
        # Something else already provides the global symbol (LD_PRELOAD, an earlier load): MLX
        # will bind to that one, so report it rather than the file we opened.
        info = _describe_global(owner)
        info.reason = f"{SYMBOL} is already provided globally by {owner}; {path} was not used"
        return info
    return BlasInfo(name, path, True, f"{how}; MLX will use its {SYMBOL}", threads=threads)


def _describe_global(owner: str) -> BlasInfo:
    try:
        lib = _dlopen(owner, os.RTLD_LOCAL)
        name, threads = _identify(lib)
    except OSError:
        name, threads = Path(owner).name, None
    return BlasInfo(name, owner, True, f"{SYMBOL} is provided globally by {owner}", threads=threads)


def _identify(lib: ctypes.CDLL) -> tuple[str, int | None]:
    if _has(lib, "openblas_get_config"):
        fn = lib.openblas_get_config
        fn.restype = ctypes.c_char_p
        try:
            config = (fn() or b"").decode(errors="replace").split()
        except Exception:  # noqa: BLE001 - an odd build; the name is cosmetic
            config = []
        version = config[1] if len(config) > 1 and config[0] == "OpenBLAS" else ""
        threads = None
        if _has(lib, "openblas_get_num_threads"):
            lib.openblas_get_num_threads.restype = ctypes.c_int
            threads = int(lib.openblas_get_num_threads())
        return (f"OpenBLAS {version}".strip(), threads)
    if _has(lib, "bli_info_get_version_str"):
        return ("BLIS", None)
    if _has(lib, "MKL_Get_Max_Threads"):
        return ("MKL", None)
    return ("BLAS (exports cblas_sgemm)", None)


def _pypi_candidates() -> list[tuple[str, str]]:
    out = []
    try:
        spec = importlib.util.find_spec("ngsolve_openblas")
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        for loc in spec.submodule_search_locations or []:
            for lib in sorted(glob.glob(os.path.join(loc, "libopenblas*.so*"))):
                out.append(("PyPI ngsolve-openblas", lib))
    for entry in sys.path:
        lib = os.path.join(entry or ".", "cmeel.prefix", "lib", "libopenblas.so.0")
        if os.path.exists(lib):
            out.append(("PyPI cmeel-openblas", lib))
    return out


def _mlx_imported() -> bool:
    return "mlx.core" in sys.modules


def _dlopen(path: str, mode: int) -> ctypes.CDLL:
    return ctypes.CDLL(path, mode=mode)


def _has(lib: ctypes.CDLL, symbol: str) -> bool:
    try:
        getattr(lib, symbol)
        return True
    except AttributeError:
        return False


def _real(path: str) -> str:
    return os.path.realpath(path) if path else path


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _dladdr_path(addr: int | None) -> str | None:
    if not addr:
        return None
    for libname in (None, "libdl.so.2"):
        try:
            dladdr = ctypes.CDLL(libname).dladdr
            break
        except (OSError, AttributeError):
            continue
    else:
        return None
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    dladdr.restype = ctypes.c_int
    info = _DlInfo()
    if not dladdr(addr, ctypes.byref(info)) or not info.dli_fname:
        return None
    return info.dli_fname.decode(errors="replace")
