// The gdn bindings built with the CPU emulation of the device runtime (-DDS_EMU).
#include "ops/gdn.cu"
