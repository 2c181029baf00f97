"""Pure logic, no I/O: route validation and canonical form, the codec and its streams,
statistics, compression at rest, sampling and route sources."""
