from kareus.cli import main


def test_gpus_and_workloads_list_presets(capsys):
    assert main(["gpus"]) == 0
    out = capsys.readouterr().out
    for name in ("a100-40gb", "h100-sxm", "h200-sxm"):
        assert name in out
    assert main(["workloads"]) == 0
    out = capsys.readouterr().out
    for name in ("llama3.2-3b", "qwen3-1.7b", "llama3.3-70b"):
        assert name in out
    assert "28672" in out


def test_help_without_command(capsys):
    assert main([]) == 0
    assert "usage: kareus" in capsys.readouterr().out
