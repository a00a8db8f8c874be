// The MoE bindings built with the CPU emulation of the device runtime (-DDS_EMU).
#include "ops/moe.cu"
