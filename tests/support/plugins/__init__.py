"""A third implementation of each seam, one file each, registered the way an installed package
registers its plugins (entry points; tests/deploy/test_plugin_registry.py writes them)."""
