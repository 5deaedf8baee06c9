"""``request_amx_permission`` (pykv/connector/amx.py): asks only where the CPU has AMX, says so
when the kernel refuses, and never raises. The end-to-end proof is test_calibrate_e2e's disk
engine, whose first forward is a whole-prompt hit: without the permission vLLM's AMX attention
kernel died with SIGILL on this project's Xeon CI machines."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")

from pykv.connector.amx import request_amx_permission  # noqa: E402


def test_no_amx_asks_nothing(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: asked.append(1) or True)
    assert request_amx_permission() is False and asked == []


def test_amx_is_asked_for_and_a_refusal_is_logged(monkeypatch, caplog):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: True)
    assert request_amx_permission() is True
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: False)
    with caplog.at_level(logging.WARNING, logger="pykv.connector.amx"):
        assert request_amx_permission() is False
    assert "refused AMX" in caplog.text


def test_a_torch_without_the_calls_is_left_alone(monkeypatch):
    monkeypatch.delattr(torch.cpu, "_init_amx")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert request_amx_permission() is False


def test_on_this_machine_it_returns_a_bool():
    assert request_amx_permission() in (True, False)
