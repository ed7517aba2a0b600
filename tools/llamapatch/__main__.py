from tools.llamapatch import main

main()
