"""Presets for real agent CLIs, one small module each.

A module here is found by name: `polar.harness.presets.codex` is the preset `codex`. It defines `PRESET`,
the class implementing `polar.harness.base.Harness`. Adding a CLI is adding one module (see
docs/harnesses.md); `shell` stays the escape hatch for anything else.
"""
