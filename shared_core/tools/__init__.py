"""Tools around the engines (layer 4): the `specrag` CLI, the demo, drafter tuning and plug-ins for
other systems."""
