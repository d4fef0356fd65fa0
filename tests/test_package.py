"""The top-level package exports the main names, each the same object as in its home module."""

from __future__ import annotations

import importlib

import pytest

import hybrid_attention


@pytest.mark.parametrize("name", sorted(hybrid_attention._EXPORTS))
def test_top_level_export_is_the_home_object(name):
    home = importlib.import_module(hybrid_attention._EXPORTS[name])
    assert getattr(hybrid_attention, name) is getattr(home, name)
    assert name in dir(hybrid_attention) and name in hybrid_attention.__all__


def test_unknown_top_level_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchThing'"):
        hybrid_attention.NoSuchThing  # noqa: B018


def test_top_level_import_builds_and_runs_a_model():
    from hybrid_attention import HybridConfig, HybridLM

    model = HybridLM(HybridConfig.from_preset("tiny"))
    ids = __import__("torch").randint(0, 256, (1, 5))
    assert model(ids).logits.shape == (1, 5, 256)
