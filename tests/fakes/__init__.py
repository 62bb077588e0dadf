"""Stand-ins for packages that cannot be installed here, used only inside tests (never on sys.path as the real ones)."""
