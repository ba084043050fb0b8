"""docs/configuration.md is generated from kvserve/config.py: every setting it lists needs a description there,
and the committed page must be what the generator writes now."""
from __future__ import annotations

from kvserve import config_reference as R


def test_every_setting_has_a_description():
    missing = R.missing_descriptions()
    assert not missing, ("settings without a description: add a comment on or just above the field in "
                         f"kvserve/config.py, then run `{R.REGENERATE}`: " + ", ".join(missing))


def test_the_page_is_what_the_generator_writes():
    assert R.PAGE.exists(), f"{R.PAGE} is missing: run `{R.REGENERATE}`"
    assert R.PAGE.read_text() == R.render(), f"{R.PAGE} is out of date: run `{R.REGENERATE}`"


def test_descriptions_come_from_metadata_comments_above_and_trailing_comments():
    source = '''
@dataclass(frozen=True)
class Demo:
    a: int = 1  # trailing
    # above, first line
    # and second
    b: int = 2  # and trailing

    c: int = 3
    d: dict = field(default_factory=dict, metadata={"doc": "from metadata"})  # not this
    e: str = (
        "x"  # on a continuation line
    )
'''
    docs = R.field_docs(source)["Demo"]
    assert docs == {"a": "trailing", "b": "above, first line and second and trailing", "c": "",
                    "d": "from metadata", "e": "on a continuation line"}


def test_a_setting_without_a_description_is_reported():
    docs = R.field_docs()
    docs["CacheConfig"]["block_size"] = ""
    assert R.missing_descriptions(docs) == ["CacheConfig.block_size"]


def test_every_table_of_the_models_file_has_a_section():
    """The tables ServerConfig.from_toml reads, each documented (and nothing else)."""
    tables = {s.table.split()[0] for s in R.SECTIONS}
    assert tables == {"[server]", "[server.auto]", "[[models]]", "[models.interactive]", "[[models.adapters]]", "[models.price]",
                      "[models.fleet]", "[fleet]", "[batch]", "[regions]", "[[regions.peers]]", "[regions.policy]",
                      "[regions.escrow]"}


def test_every_config_dataclass_has_a_section_or_a_reason():
    """A new config dataclass is a decision: a table of the models file (a section) or not a setting (why)."""
    import dataclasses
    import inspect

    from kvserve import config as C

    found = {name for name, cls in inspect.getmembers(C, inspect.isclass)
             if dataclasses.is_dataclass(cls) and cls.__module__ == C.__name__}
    covered = {s.cls.__name__ for s in R.SECTIONS} | set(R.NOT_SETTINGS)
    assert found == covered, (f"kvserve/config.py dataclasses without a section in kvserve/config_reference.py "
                              f"(SECTIONS, or NOT_SETTINGS with the reason): {sorted(found - covered)}; "
                              f"gone: {sorted(covered - found)}")
