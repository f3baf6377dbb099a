# Enables the harness's pytest options (--lce-impl, --lce-profile, ...) and fixtures.
pytest_plugins = ["verify.pytest_plugin"]
