import subprocess
import sys


def test_import_is_light():
    code = ("import sys, kareus, kareus.model, kareus.search, kareus.compose, kareus.exec, "
            "kareus.cli\n"
            "heavy = [m for m in ('torch', 'xgboost', 'pynvml', 'matplotlib') if m in sys.modules]\n"
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_public_api_is_exported():
    import kareus

    for name in kareus.__all__:
        assert hasattr(kareus, name), name
