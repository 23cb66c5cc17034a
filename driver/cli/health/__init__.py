"""`gpu-dra health`: show and clear device health, per node or for all nodes."""
