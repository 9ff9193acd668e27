"""GPU, model and schedule names are case-insensitive; files and results keep lower case."""

from __future__ import annotations

import attrs

from kareus.model import (
    GPU_PRESETS,
    Workload,
    files,
    get_gpu,
    get_model,
    get_schedule,
    gpu_names,
    model_names,
)


def test_presets_are_found_in_any_case_and_named_in_lower_case():
    assert get_gpu("H200-SXM") is GPU_PRESETS["h200-sxm"]
    wl = Workload.preset("Qwen3-1.7B", tp=2)
    assert wl.model.name == "qwen3-1.7b" and wl.to_dict()["model"]["name"] == "qwen3-1.7b"
    assert get_model("LLAMA3.2-3B") is get_model("llama3.2-3b")
    assert get_schedule("GPipe", 2, 2).name == get_schedule("gpipe", 2, 2).name


def test_registered_names_are_kept_in_lower_case_and_found_in_any():
    gpu = attrs.evolve(get_gpu("h200-sxm"), name="Lab-GPU", power_limit_w=600.0)
    arch = attrs.evolve(get_model("qwen3-1.7b"), name="My-1.7B", layers=20)
    assert gpu.name == "lab-gpu" and arch.name == "my-1.7b"
    try:
        assert files.register_gpu(gpu).name == "lab-gpu"
        assert get_gpu("LAB-gpu") is gpu and "lab-gpu" in gpu_names()
        files.register_model(arch)
        assert Workload.preset("MY-1.7b", tp=2).model is arch
        assert gpu.to_dict()["name"] == "lab-gpu" and arch.to_dict()["name"] == "my-1.7b"
    finally:
        files.unregister("lab-gpu")
        files.unregister("MY-1.7B")
    assert "my-1.7b" not in model_names()
