"""CDI specs: one per claim, the common spec, the driver's edits and device nodes, the hook."""
