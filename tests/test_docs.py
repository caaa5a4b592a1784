"""Every registered method has a docs page that names each of its config fields."""

from pathlib import Path

import pytest

from atorch.auto import get_method, method_names

DOCS = Path(__file__).resolve().parents[1] / "docs" / "methods"


@pytest.mark.parametrize("name", method_names())
def test_method_page_lists_every_field(name):
    page = DOCS / f"{name}.md"
    assert page.is_file(), f"docs/methods/{name}.md is missing"
    text = page.read_text()
    missing = [field for field in get_method(name).config_cls.model_fields if f"`{field}`" not in text]
    assert not missing, f"docs/methods/{name}.md does not describe {missing}"
