raise RuntimeError("this plugin is broken at import")
