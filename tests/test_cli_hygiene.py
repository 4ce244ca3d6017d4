"""Command-line hygiene shared by every subcommand: no flag prefixes, one-line errors, the model argument
spelled both ways with `~` expanded, CPU-sized defaults, the CPU thread policy."""

from __future__ import annotations

import os

import pytest
import torch

from detinfer import cli_util
from detinfer.engine import generate_cli
from detinfer.repro import audit
from detinfer.repro import cli as repro_cli

PARSERS = {"generate": generate_cli.build_parser, "repro": repro_cli.build_parser, "audit": audit.build_parser}


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_a_flag_prefix_is_an_error_not_another_flag(name, capsys):
    """`--max-token 8` (a typo) must not be taken for --max-tokens: with prefixes on, repro accepted it and
    started a 127-hour job."""
    parser = PARSERS[name]()
    assert parser.allow_abbrev is False
    prefix = {"generate": ["--max-token", "8"], "repro": ["--max-token", "8"], "audit": ["--prompt", "2"]}[name]
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["somedir", "--prompt", "p", *prefix] if name != "audit" else ["somedir", *prefix])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments" in err and prefix[0] in err


def test_every_parser_in_the_package_refuses_prefixes():
    """Every argparse parser the subcommands build (demo and pull included)."""
    from detinfer import demo
    from detinfer.models import pull

    for main in (demo.main, pull.main):
        with pytest.raises(SystemExit) as e:
            main(["--shuffle", "3"] if main is demo.main else ["smollm2-135m-instruct", "--cach", "x"])
        assert e.value.code == 2


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_errors_are_one_line(name, capsys):
    with pytest.raises(SystemExit):
        PARSERS[name]().parse_args(["m", "--prompt", "p", "--no-such-flag"] if name != "audit" else
                                   ["m", "--no-such-flag"])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "usage:" not in err
    assert "--no-such-flag" in err and "--help" in err


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_model_positional_or_flag_with_tilde_expanded(name):
    parser = PARSERS[name]()
    home = os.path.expanduser("~")
    for argv in (["~/m"], ["--model", "~/m"], ["--model=~/m"], ["~/m", "--model", "~/m"]):
        extra = ["--prompt", "p"] if name in ("generate", "repro") else []
        ns = parser.parse_args(argv + extra)
        assert cli_util.model_path(parser, ns) == os.path.join(home, "m"), argv


def test_model_given_twice_differently_is_an_error(capsys):
    parser = repro_cli.build_parser()
    ns = parser.parse_args(["a", "--model", "b", "--prompt", "p"])
    with pytest.raises(SystemExit):
        cli_util.model_path(parser, ns)
    assert "given twice" in capsys.readouterr().err


def test_repro_sizes_its_defaults_by_device(capsys):
    ns = repro_cli.build_parser().parse_args(["m", "--prompt", "p", "--device", "cpu"])
    repro_cli._size_defaults(ns)
    assert (ns.n, ns.max_tokens) == (repro_cli.CPU_DEFAULTS["n"], repro_cli.CPU_DEFAULTS["max_tokens"])
    assert "CPU-sized defaults" in capsys.readouterr().err
    ns = repro_cli.build_parser().parse_args(["m", "--prompt", "p", "--device", "cuda"])
    repro_cli._size_defaults(ns)
    assert (ns.n, ns.max_tokens) == (1000, 256)
    ns = repro_cli.build_parser().parse_args(["m", "--prompt", "p", "--device", "cpu", "--n", "3"])
    repro_cli._size_defaults(ns)
    assert (ns.n, ns.max_tokens) == (3, repro_cli.CPU_DEFAULTS["max_tokens"])  # given flags win


def test_audit_sizes_its_defaults_by_device():
    ns = audit.build_parser().parse_args(["m", "--device", "cpu", "--prompts", "3"])
    audit._fill_defaults(ns)
    assert ns.prompts == 3 and ns.max_len == audit.CPU_DEFAULTS["max_len"]
    ns = audit.build_parser().parse_args(["m", "--device", "cuda"])
    audit._fill_defaults(ns)
    assert ns.prompts == audit.AuditConfig.prompts and ns.max_len == audit.AuditConfig.max_len


def test_cpu_thread_policy(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("DETINFER_CPU_THREADS", "1")
        assert cli_util.cpu_thread_policy("cpu") == 1 and torch.get_num_threads() == 1
        assert cli_util.cpu_thread_policy("cuda") is None
        monkeypatch.delenv("DETINFER_CPU_THREADS")
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setattr(os, "getloadavg", lambda: (float(os.cpu_count() or 1) + 3, 0.0, 0.0))
        torch.set_num_threads(before)
        assert cli_util.cpu_thread_policy("cpu") == 1  # every core busy: one thread
    finally:
        torch.set_num_threads(before)


def test_repro_never_calls_the_users_value_a_default(capsys):
    ns = repro_cli.build_parser().parse_args(["m", "--prompt", "p", "--device", "cpu", "--n", "0"])
    repro_cli._size_defaults(ns)
    err = capsys.readouterr().err
    assert "--max-tokens 64" in err and "--n" not in err


def test_version_flag_prints_the_package_version(capsys):
    from detinfer import __version__
    from detinfer.cli import main

    for flag in ("--version", "-V"):
        assert main([flag]) == 0
        assert capsys.readouterr().out.strip() == f"detinfer {__version__}"


def test_pull_without_a_name_says_what_to_give(capsys):
    from detinfer.models import pull

    assert pull.main([]) == 2
    err = capsys.readouterr().err
    assert "usage: detinfer pull" in err and "give the name of the model" in err
    assert all(name in err for name in pull.REGISTRY)


@pytest.mark.parametrize("name", ["generate", "repro"])
def test_generate_and_repro_send_raw_text_unless_chat(name):
    """Both commands take the prompt as raw text by default (vLLM's generate / completions) and take
    --chat and --no-chat; before, generate had no --no-chat and repro defaulted to the chat template."""
    parser = PARSERS[name]()
    assert parser.parse_args(["m", "--prompt", "p"]).chat is False
    assert parser.parse_args(["m", "--prompt", "p", "--chat"]).chat is True
    assert parser.parse_args(["m", "--prompt", "p", "--chat", "--no-chat"]).chat is False


def test_repro_config_default_matches_the_cli():
    from detinfer.repro.experiment import ReproConfig

    assert ReproConfig().chat is False


def test_check_outcome_says_failed_on_stderr_with_status_1_else_passed_on_stdout(capsys):
    assert cli_util.check_outcome("not reproducible: deterministic", "ignored") == 1
    out, err = capsys.readouterr()
    assert out == "" and err == "check FAILED: not reproducible: deterministic\n"
    assert cli_util.check_outcome(None, "deterministic reproduced bit for bit") == 0
    out, err = capsys.readouterr()
    assert out == "check passed: deterministic reproduced bit for bit\n" and err == ""
