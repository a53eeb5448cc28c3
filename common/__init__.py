"""The bottom layer: the deployment config and the trace formats, which every
other package reads and which import nothing of kvserve's own."""
