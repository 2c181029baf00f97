"""What crosses the wire, shared by server and client: the Arrow IPC formats (`wire`,
read through `ipc`), the JSON models of the control plane (`models`) and direct-read
plans (`plans`)."""
