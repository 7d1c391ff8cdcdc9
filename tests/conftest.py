import os
import sys

# tests/ holds helper modules (f64_math) imported by name.
sys.path.insert(0, os.path.dirname(__file__))


def slow_enabled(config) -> bool:
    return bool(os.environ.get("GDN_JAX_SLOW")) or "slow" in (config.getoption("-m") or "")


def pytest_collection_modifyitems(config, items):
    """The default run samples: exhaustive cases marked @pytest.mark.slow are deselected
    (not skipped) unless GDN_JAX_SLOW=1 or `-m slow` asks for them."""
    if slow_enabled(config):
        return
    slow = [it for it in items if it.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [it for it in items if not it.get_closest_marker("slow")]
