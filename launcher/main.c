/* placeholder entry point, replaced by the launcher */
#include <stdio.h>
int main(void) { fputs("flotilla: not built yet\n", stderr); return 1; }
