"""`gpu-dra journal`: show the node's journal, quarantine a corrupt one."""
