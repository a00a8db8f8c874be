// The op schemas and Meta implementations, registered as deltaserve_emu (-DDS_EMU).
#include "ops/registry.cpp"
