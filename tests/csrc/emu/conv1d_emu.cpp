// The conv1d bindings built with the CPU emulation of the device runtime (-DDS_EMU).
#include "ops/conv1d.cu"
