"""Plugin modules for the registry tests: one good, and stand-ins that inject each fault a real
third-party plugin can have (they are not engines and claim no engine behaviour)."""
