// The paged attention bindings built with the CPU emulation of the device runtime (-DDS_EMU).
#include "ops/attention.cu"
