from gateway.service import main

main()
