"""The plugin's gRPC sockets: the kubelet registration handshake, the socket paths,
and the servers rebuilt when their socket file vanishes."""
