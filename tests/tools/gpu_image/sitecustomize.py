"""Imported at start by every Python process whose PYTHONPATH holds this folder (the gpu-check
smoke test): the GPU image's package set and a plain checkout. The packages that image lacks
(Ray, starlette, uvicorn, llguidance, openai, jsonschema) raise ImportError, and this venv's
editable install of the project is taken off the import system, so `runtime` and the other
packages import only from a path the process itself puts on sys.path."""
import sys

BLOCKED = frozenset({"ray", "starlette", "uvicorn", "llguidance", "openai", "jsonschema"})


class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ImportError(f"No module named {name!r} (not on the GPU image)")
        return None


sys.meta_path[:] = [_Blocked()] + [f for f in sys.meta_path
                                   if not getattr(f, "__module__", "").startswith("__editable__")
                                   and not type(f).__module__.startswith("__editable__")]
sys.path_hooks[:] = [h for h in sys.path_hooks if not getattr(h, "__module__", "").startswith("__editable__")]
sys.path_importer_cache.clear()
