"""Generated gRPC stubs of orpheus.proto (regenerate with scripts/gen_proto.sh)."""
