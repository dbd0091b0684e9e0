"""The package: one import name, three layers, nothing stale, a wheel that installs beside a user's own folders."""
